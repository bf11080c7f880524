package toolrun

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/pkg/errdefs"
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
	for {
		if b, err := os.ReadFile(pidFile); err == nil && strings.HasSuffix(string(b), "\n") {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	os.Stdout.WriteString(strconv.Itoa(active.Load().pid) + "\n")
	select {}
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

// TestSpawnerSmallFileTable: the spawner holds a handful of descriptors
// however many this process holds, so the tools it starts copy no big
// file table; a tool it starts gets only its standard ones.
func TestSpawnerSmallFileTable(t *testing.T) {
	s := withSpawner(t)
	for range 200 {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
	}
	out, err := Runner{}.Run(t.Context(), sh, []string{"-c", "ls /proc/self/fd | wc -l"})
	if err != nil {
		t.Fatal(err)
	}
	// stdin, stdout, stderr and the directory ls reads.
	if n, err := strconv.Atoi(out); err != nil || n > 4 {
		t.Errorf("a tool holds %q descriptors, want its standard three and ls's own", out)
	}
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(s.pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	// The standard three, the control socket, the Go runtime's poller,
	// the last request's descriptors while it finishes, what the test
	// harness leaks to its children: a handful against over 200 here.
	if len(ents) > 16 {
		var held []string
		for _, e := range ents {
			l, _ := os.Readlink("/proc/" + strconv.Itoa(s.pid) + "/fd/" + e.Name())
			held = append(held, e.Name()+"="+l)
		}
		t.Fatalf("the spawner holds %d descriptors while this process holds over 200: %v", len(ents), held)
	}
}

// TestSpawnerCancel: a call whose context ends returns only once the
// tool is gone.
func TestSpawnerCancel(t *testing.T) {
	withSpawner(t)
	pidFile := t.TempDir() + "/pid"
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		for {
			if b, err := os.ReadFile(pidFile); err == nil && len(b) > 0 {
				cancel()
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	_, err := Runner{}.Run(ctx, sh, []string{"-c", "echo $$ > " + pidFile + "; exec sleep 600"})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run with its context cancelled: %v, want context.Canceled", err)
	}
	b, _ := os.ReadFile(pidFile)
	pid := strings.TrimSpace(string(b))
	if pid == "" {
		t.Fatal("the tool wrote no pid")
	}
	// The spawner reaps the tool before it replies: no trace is left.
	if st, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil {
		t.Fatalf("the tool (pid %s) is still there after Run returned: %s", pid, st)
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
