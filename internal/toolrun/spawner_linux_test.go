package toolrun

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestMain lets this test binary serve as the spawner StartSpawner starts.
// As TestSpawnerEndsWithItsParent's child it is a plugin that starts a
// spawner and a tool through it, then waits to be killed.
func TestMain(m *testing.M) {
	ServeSpawnerIfAsked()
	if pidFile := os.Getenv("MOUNTPLAN_TOOLRUN_HELPER"); pidFile != "" {
		os.Exit(pluginWithTool(pidFile))
	}
	os.Exit(m.Run())
}

// pluginWithTool starts a spawner and a long tool through it that writes
// its pid to pidFile, prints the spawner's pid and blocks.
func pluginWithTool(pidFile string) int {
	if err := StartSpawner(); err != nil {
		return 2
	}
	go func() {
		_, _ = Runner{}.Run(context.Background(), sh, []string{"-c", "echo $$ > " + pidFile + "; exec sleep 600"})
	}()
	waitLine[struct{}](pidFile, nil)
	os.Stdout.WriteString(strconv.Itoa(active.Load().pid) + "\n")
	select {}
}

// waitLine waits until a tool has written a whole line to path and
// returns it trimmed, or "" once stop fires (nil: wait for ever).
func waitLine[T any](path string, stop <-chan T) string {
	for {
		if b, err := os.ReadFile(path); err == nil && strings.HasSuffix(string(b), "\n") {
			return strings.TrimSpace(string(b))
		}
		select {
		case <-stop:
			return ""
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// withSpawner starts a spawner for one test and puts direct starts back
// afterwards; the spawner ends when its control socket closes.
func withSpawner(t *testing.T) *spawner {
	t.Helper()
	if err := StartSpawner(); err != nil {
		t.Fatal(err)
	}
	s := active.Load()
	t.Cleanup(func() {
		active.Store(nil)
		s.ctl.Close()
	})
	return s
}

func TestSpawnerRuns(t *testing.T) {
	withSpawner(t)
	withEnv := Tool{Name: "sh", Package: "dash", Env: []string{"MOUNTPLAN_TOOLRUN_ADDED=added"}}
	out, err := Runner{}.Run(t.Context(), withEnv, []string{"-c", `echo "$MOUNTPLAN_TOOLRUN_ADDED $$ $PPID"; echo oops >&2; exit 7`})
	if Status(err) != 7 {
		t.Fatalf("Run through the spawner: %q, %v, want exit status 7", out, err)
	}
	fields := strings.Fields(strings.Split(out, "\n")[0])
	if len(fields) != 3 || fields[0] != "added" || !strings.HasSuffix(out, "oops") {
		t.Fatalf("output %q, want the added variable, the pids and stderr", out)
	}
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(active.Load().pid) + "/comm")
	if err != nil || strings.TrimSpace(string(comm)) != SpawnerComm {
		t.Errorf("the spawner's command name is %q (%v), want %q", comm, err, SpawnerComm)
	}
	// The tool's parent is the spawner, not this process.
	if fields[2] == strconv.Itoa(os.Getpid()) {
		t.Errorf("the tool's parent is this process (%s): it was not started by the spawner", fields[2])
	}
	if _, err := (Runner{}).Run(t.Context(), sh, []string{"-c", "exit 0"}); err != nil {
		t.Fatalf("a tool that succeeds: %v", err)
	}
	_, err = Runner{}.Run(t.Context(), Tool{Name: "mountplan-no-such-tool", Package: "none"}, nil)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a missing tool through the spawner: %v, want FailedPrecondition", err)
	}
	_, err = Runner{}.Run(t.Context(), sh, []string{"-c", "kill -9 $$"})
	if err == nil || Status(err) != -1 {
		t.Fatalf("a tool killed by a signal: %v (status %d), want an error with status -1", err, Status(err))
	}
}

// TestSpawnerSmallFileTable: a tool the spawner starts gets only its
// standard descriptors, and the spawner's own table does not grow with
// the requests it served, finished, failed or cancelled.
func TestSpawnerSmallFileTable(t *testing.T) {
	s := withSpawner(t)
	out, err := Runner{}.Run(t.Context(), sh, []string{"-c", "ls /proc/self/fd | wc -l"})
	if err != nil {
		t.Fatal(err)
	}
	// stdin, stdout, stderr and the directory ls reads.
	if n, err := strconv.Atoi(out); err != nil || n > 4 {
		t.Errorf("a tool holds %q descriptors, want its standard three and ls's own", out)
	}
	before := spawnerFds(t, s.pid)
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	for i := range 30 {
		_, _ = Runner{}.Run(t.Context(), sh, []string{"-c", "exit " + strconv.Itoa(i%2)})
		_, _ = Runner{}.Run(cancelled, sh, []string{"-c", "exit 0"})
		runCancelledMidway(t, "sleep 600")
	}
	// A reply's descriptors close a moment after the reply is sent.
	var after []string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if after = spawnerFds(t, s.pid); len(after) <= len(before) || time.Now().After(deadline) {
			break
		}
	}
	if len(after) > len(before) {
		t.Fatalf("the spawner held %d descriptors before 90 requests and %d after: %v", len(before), len(after), after)
	}
}

func spawnerFds(t *testing.T, pid int) []string {
	t.Helper()
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var held []string
	for _, e := range ents {
		l, _ := os.Readlink(dir + "/" + e.Name())
		held = append(held, e.Name()+"="+l)
	}
	return held
}

// runCancelledMidway runs script through the spawner, cancels the call
// once the tool is running and returns the tool's pid and parent pid.
func runCancelledMidway(t *testing.T, script string) (pid, ppid string) {
	t.Helper()
	pidFile := t.TempDir() + "/pid"
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() {
		if waitLine(pidFile, ctx.Done()) != "" {
			cancel()
		}
	}()
	_, err := Runner{}.Run(ctx, sh, []string{"-c", "echo $$ $PPID > " + pidFile + "; exec " + script})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run with its context cancelled: %v, want context.Canceled", err)
	}
	b, _ := os.ReadFile(pidFile)
	f := strings.Fields(string(b))
	if len(f) != 2 {
		t.Fatalf("the tool wrote %q, want its pid and its parent's", b)
	}
	return f[0], f[1]
}

// TestSpawnerCancel: a call whose context ends returns only once the
// tool (started by the spawner) is gone, and a call whose context ended
// before it was made starts nothing.
func TestSpawnerCancel(t *testing.T) {
	s := withSpawner(t)
	pid, ppid := runCancelledMidway(t, "sleep 600")
	if ppid != strconv.Itoa(s.pid) {
		t.Fatalf("the tool's parent is %s, want the spawner (%d)", ppid, s.pid)
	}
	// The spawner reaps the tool before it replies: no trace is left.
	if st, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil {
		t.Fatalf("the tool (pid %s) is still there after Run returned: %s", pid, st)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	ran := t.TempDir() + "/ran"
	for range 50 {
		if _, err := (Runner{}).Run(ctx, sh, []string{"-c", "touch " + ran}); !errors.Is(err, context.Canceled) {
			t.Fatalf("Run with a context cancelled before: %v, want context.Canceled", err)
		}
	}
	if _, err := os.Stat(ran); err == nil {
		t.Fatal("a call whose context had ended before it was made ran its tool")
	}
}

// TestSpawnerSignals: SIGTERM and SIGINT (a stop, Ctrl-C on the group)
// leave the spawner serving; when it dies anyway, the call fails at once
// and its tool dies with it.
func TestSpawnerSignals(t *testing.T) {
	s := withSpawner(t)
	// A served request: the spawner is past its start, signals caught.
	if _, err := (Runner{}).Run(t.Context(), sh, []string{"-c", "exit 0"}); err != nil {
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		if err := syscall.Kill(s.pid, sig); err != nil {
			t.Fatal(err)
		}
	}
	out, err := Runner{}.Run(t.Context(), sh, []string{"-c", "echo $PPID"})
	if err != nil || out != strconv.Itoa(s.pid) {
		t.Fatalf("a tool after SIGTERM and SIGINT to the spawner: %q, %v, want started by the spawner %d", out, err, s.pid)
	}
	pidFile := t.TempDir() + "/pid"
	done := make(chan error, 1)
	go func() {
		_, err := Runner{}.Run(t.Context(), sh, []string{"-c", "echo $$ > " + pidFile + "; exec sleep 600"})
		done <- err
	}()
	tool := waitLine(pidFile, time.After(10*time.Second))
	if tool == "" {
		t.Fatal("the tool did not start")
	}
	if err := syscall.Kill(s.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil || Status(err) != -1 {
			t.Fatalf("a call whose spawner was killed: %v, want a failure", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a call whose spawner was killed has not returned after 10 s")
	}
	if !testGone(tool, 10*time.Second) {
		t.Fatalf("the tool (pid %s) still runs 10 s after its spawner was killed", tool)
	}
}

// TestSpawnerEndsWithItsParent: the spawner exits when the plugin's end
// of its control socket closes (the plugin died), and its tools with it.
func TestSpawnerEndsWithItsParent(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	pidFile := t.TempDir() + "/tool.pid"
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), "MOUNTPLAN_TOOLRUN_HELPER="+pidFile)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, _ := out.Read(buf)
	spawner := strings.TrimSpace(string(buf[:n]))
	b, err := os.ReadFile(pidFile)
	tool := strings.TrimSpace(string(b))
	if _, aerr := strconv.Atoi(spawner); aerr != nil || err != nil {
		t.Fatalf("the helper printed %q, its tool wrote %q (%v)", buf[:n], b, err)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	for _, p := range []struct{ what, pid string }{{"the spawner", spawner}, {"its tool", tool}} {
		if !testGone(p.pid, 10*time.Second) {
			t.Errorf("%s (pid %s) still runs 10 s after the plugin died", p.what, p.pid)
		}
	}
}

// testGone waits until pid is gone or a zombie.
func testGone(pid string, timeout time.Duration) bool {
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		st, err := os.ReadFile("/proc/" + pid + "/stat")
		if err != nil || strings.Contains(string(st), ") Z ") {
			return true
		}
	}
	return false
}
