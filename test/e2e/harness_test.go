package e2e

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestMain removes the binaries that testutil.BuildOnce built. It is the
// only TestMain of this package.
func TestMain(m *testing.M) { testutil.Main(m) }

// recordingTB stands in for a test whose failure is the expected outcome:
// it records errors instead of failing the real test.
type recordingTB struct {
	testing.TB
	mu   sync.Mutex
	errs []string
}

func (r *recordingTB) Helper() {}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *recordingTB) Error(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprint(args...))
}

func (r *recordingTB) Logf(format string, args ...any) {
	r.TB.Logf("(recorded) "+format, args...)
}

func (r *recordingTB) errors() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.errs, "\n")
}

func hasMount(t *testing.T, pid int, mountPoint string) bool {
	t.Helper()
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, mi := range infos {
		if mi.Mountpoint == mountPoint {
			return true
		}
	}
	return false
}

func TestHarnessUnshareNamespace(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	ns := testutil.StartUnshare(t)

	host, err := testutil.MountNamespaceOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if ns.MountNS() == host {
		t.Fatalf("unshare process %d is in the host mount namespace %s", ns.PID, host)
	}

	dir := t.TempDir()
	if _, err := ns.Exec(t, "mount", "-t", "tmpfs", "-o", "size=1m", "mptest", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := ns.Exec(t, "sh", "-c", "echo inside > "+dir+"/f"); err != nil {
		t.Fatal(err)
	}
	if out, err := testutil.Exec(t, ns.PID, "cat", dir+"/f"); err != nil || out != "inside\n" {
		t.Fatalf("reading the file inside the namespace: %q, %v", out, err)
	}
	if !hasMount(t, ns.PID, dir) {
		t.Errorf("%s is not in the namespace's mountinfo", dir)
	}
	if hasMount(t, os.Getpid(), dir) {
		t.Errorf("%s leaked into the host's mountinfo", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "f")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the file written on the namespace's tmpfs is visible on the host: %v", err)
	}
	if _, err := ns.Exec(t, "cat", dir+"/nonexistent"); err == nil {
		t.Error("Exec of a failing command returned no error")
	}

	ns.Kill()
	ns.Kill() // idempotent
	if _, err := testutil.MountNamespaceOf(ns.PID); err == nil {
		t.Errorf("process %d still exists after Kill", ns.PID)
	}
}

// leakSome creates one of each kind of leak under dir and returns a
// function that waits for the leaked process once it has been killed.
func leakSome(t *testing.T, dir string, withFuse bool) (loopDev, mountPoint, fuseMount string, sleeper *exec.Cmd) {
	t.Helper()
	img := filepath.Join(dir, "leak.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 1<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	loopDev = strings.TrimSpace(string(out))

	mountPoint = filepath.Join(dir, "m")
	if err := os.Mkdir(mountPoint, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("mptest-leak", mountPoint, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}

	if withFuse {
		// A FUSE mount without a daemon: the connection exists as soon as
		// the mount does.
		fuseMount = filepath.Join(dir, "fuse")
		if err := os.Mkdir(fuseMount, 0o755); err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd)
		if err := unix.Mount("mptest-fuse", fuseMount, "fuse.mptest", 0, opts); err != nil {
			t.Fatal(err)
		}
	}

	sleeper = exec.Command("sleep", "300")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	return loopDev, mountPoint, fuseMount, sleeper
}

func TestHarnessLeakCheckerReportsLeaks(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "losetup")
	// The outer check proves that the inner one cleaned up what it reported.
	testutil.NoLeaks(t)

	_, fuseErr := os.Stat("/dev/fuse")
	withFuse := fuseErr == nil
	if !withFuse {
		t.Log("no /dev/fuse: FUSE connection leaks not checked")
	}
	dir := t.TempDir()
	before := testutil.TakeSnapshot()
	loopDev, mountPoint, fuseMount, sleeper := leakSome(t, dir, withFuse)

	// FindLeaks classifies each leak.
	kinds := map[string][]string{}
	for _, l := range testutil.FindLeaks(before, testutil.TakeSnapshot(), dir) {
		kinds[l.Kind] = append(kinds[l.Kind], l.What)
	}
	check := func(kind, want string) {
		t.Helper()
		for _, what := range kinds[kind] {
			if strings.Contains(what, want) {
				return
			}
		}
		t.Errorf("FindLeaks: no %s leak mentioning %q; found %v", kind, want, kinds)
	}
	check("loop device", loopDev)
	check("loop device", filepath.Join(dir, "leak.img"))
	check("mount", mountPoint)
	check("process", fmt.Sprintf("pid %d ", sleeper.Process.Pid))
	check("process", "sleep 300")
	if withFuse {
		check("mount", fuseMount)
		check("FUSE connection", fuseMount)
	}

	// CheckNoLeaks reports them all on the test it is given...
	rec := &recordingTB{TB: t}
	start := time.Now()
	testutil.CheckNoLeaks(rec, before, dir)
	t.Logf("CheckNoLeaks with leaks took %v", time.Since(start).Round(time.Millisecond))
	report := rec.errors()
	wants := []string{loopDev, mountPoint, "sleep 300"}
	if withFuse {
		wants = append(wants, "FUSE connection", fuseMount)
	}
	for _, want := range wants {
		if !strings.Contains(report, want) {
			t.Errorf("leak report does not mention %q:\n%s", want, report)
		}
	}
	t.Logf("the leak report, as a failing test would show it:\n%s", report)

	// ...and then cleans them up: they were under the marker dir, and the
	// process descended from the test.
	_ = sleeper.Wait()
	if !sleeper.ProcessState.Exited() && sleeper.ProcessState.String() != "signal: killed" {
		t.Errorf("leaked process ended with %v, want killed", sleeper.ProcessState)
	}
	if hasMount(t, os.Getpid(), mountPoint) {
		t.Errorf("leaked mount %s was not cleaned up", mountPoint)
	}
	if withFuse && hasMount(t, os.Getpid(), fuseMount) {
		t.Errorf("leaked FUSE mount %s was not cleaned up", fuseMount)
	}
	if withFuse {
		for _, l := range testutil.FindLeaks(before, testutil.TakeSnapshot(), dir) {
			if l.Kind == "FUSE connection" {
				t.Errorf("leaked FUSE connection not cleaned up: %s", l.What)
			}
		}
	}
	name := filepath.Base(loopDev)
	if b, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file"); err == nil && strings.HasPrefix(string(b), dir) {
		t.Errorf("leaked %s still attached to %s", loopDev, b)
	}
}

func TestHarnessLeakCheckerQuietWhenClean(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "losetup")
	testutil.NoLeaks(t)
	dir := t.TempDir()
	before := testutil.TakeSnapshot()

	loopDev, mountPoint, _, sleeper := leakSome(t, dir, false)
	// Put everything back.
	_ = sleeper.Process.Kill()
	_ = sleeper.Wait()
	if err := unix.Unmount(mountPoint, 0); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "--detach", loopDev).CombinedOutput(); err != nil {
		t.Fatalf("losetup --detach: %v: %s", err, out)
	}
	// A namespace that dies with a mount in it: the kernel drops the mount
	// asynchronously, which the check must wait out rather than report.
	ns := testutil.StartUnshare(t)
	if _, err := ns.Exec(t, "mount", "-t", "tmpfs", "mptest", mountPoint); err != nil {
		t.Fatal(err)
	}
	ns.Kill()

	rec := &recordingTB{TB: t}
	testutil.CheckNoLeaks(rec, before, dir)
	if report := rec.errors(); report != "" {
		t.Errorf("CheckNoLeaks reported leaks after a clean test:\n%s", report)
	}
}

func TestHarnessContainerd(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox")
	testutil.NoLeaks(t)
	before := testutil.TakeSnapshot()

	start := time.Now()
	ctrd := testutil.StartContainerd(t)
	started := time.Now()
	rootfs := testutil.BusyboxRootfs(t)
	built := time.Now()
	c := ctrd.Run(t, "c1", rootfs, "sleep", "3600")
	ran := time.Now()
	t.Logf("containerd up in %v; busybox rootfs built in %v; container running in %v; total %v",
		started.Sub(start).Round(time.Millisecond), built.Sub(started).Round(time.Millisecond),
		ran.Sub(built).Round(time.Millisecond), ran.Sub(start).Round(time.Millisecond))

	// The leak checker tracks the shim (reparented away from the test, but
	// its command line names containerd's directory) and the container's
	// processes under it.
	var running []string
	for _, l := range testutil.FindLeaks(before, testutil.TakeSnapshot()) {
		if l.Kind == "process" {
			running = append(running, l.What)
		}
	}
	for _, want := range []string{"containerd --config", "containerd-shim-runc-v2 -namespace " + ctrd.Namespace, fmt.Sprintf("pid %d ", c.PID())} {
		if !strings.Contains(strings.Join(running, "\n"), want) {
			t.Errorf("FindLeaks does not see %q among the new processes:\n%s", want, strings.Join(running, "\n"))
		}
	}

	host, err := testutil.MountNamespaceOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if c.PID() <= 0 || c.MountNS() == "" || c.MountNS() == host {
		t.Fatalf("container pid %d in mount namespace %q (host %s)", c.PID(), c.MountNS(), host)
	}

	execStart := time.Now()
	out, err := c.Exec(t, "cat", "/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ctr task exec took %v", time.Since(execStart).Round(time.Millisecond))
	seen := map[string]bool{}
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 4 {
			seen[f[4]] = true
		}
	}
	if !seen["/"] || !seen["/proc"] {
		t.Errorf("the container's mountinfo lacks / or /proc:\n%s", out)
	}
	// The same view through nsenter, from the host's side.
	infos, err := testutil.MountInfoOf(c.PID())
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out, "\n"); n != len(infos) {
		t.Errorf("mountinfo: %d lines from inside, %d from /proc/%d/mountinfo", n, len(infos), c.PID())
	}
	if out, err := testutil.Exec(t, c.PID(), "cat", "/etc/passwd"); err != nil || !strings.HasPrefix(out, "root:x:0:0:") {
		t.Errorf("nsenter into the container's mount namespace: %q, %v", out, err)
	}
	if hasMount(t, os.Getpid(), rootfs) {
		t.Errorf("the container's root file system is mounted in the host namespace")
	}
	_, err = c.Exec(t, "sh", "-c", "echo oops >&2; exit 3")
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "oops") {
		t.Errorf("failing exec: got %v, want exit status 3 and its stderr", err)
	}

	// Kill removes the task, the container and its processes.
	pid := c.PID()
	killStart := time.Now()
	c.Kill(t)
	t.Logf("Kill (SIGKILL, wait, delete task and container) took %v", time.Since(killStart).Round(time.Millisecond))
	if _, err := testutil.MountNamespaceOf(pid); err == nil {
		t.Errorf("container process %d still exists after Kill", pid)
	}
	for _, what := range []string{"task", "container"} {
		out, err := ctrd.Ctr(what, "list", "--quiet")
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(out) != "" {
			t.Errorf("ctr %s list after Kill: %q", what, out)
		}
	}

	// Stop also takes down a container left running.
	c2 := ctrd.Run(t, "c2", rootfs, "sleep", "3600")
	pid2 := c2.PID()
	stopStart := time.Now()
	if err := ctrd.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	t.Logf("Stop with one container running took %v", time.Since(stopStart).Round(time.Millisecond))
	if _, err := testutil.MountNamespaceOf(pid2); err == nil {
		t.Errorf("container c2 (pid %d) survived Stop", pid2)
	}
	for pid, cmdline := range processesMentioning(ctrd.Dir) {
		t.Errorf("process %d left after Stop: %s", pid, cmdline)
	}
	infos, err = testutil.MountInfoOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for _, mi := range infos {
		if strings.HasPrefix(mi.Mountpoint, ctrd.Dir) {
			t.Errorf("mount left under containerd's directory: %s", mi.Mountpoint)
		}
	}
	if _, err := os.Stat(ctrd.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("containerd's directory %s left behind: %v", ctrd.Dir, err)
	}
	if cgs, _ := filepath.Glob("/sys/fs/cgroup/*/" + ctrd.Namespace); len(cgs) > 0 {
		t.Errorf("cgroups left behind: %v", cgs)
	}
}

// processesMentioning returns the live processes whose command line
// contains s.
func processesMentioning(s string) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || len(b) == 0 {
			continue
		}
		cmdline := strings.ReplaceAll(string(b), "\x00", " ")
		if strings.Contains(cmdline, s) {
			out[pid] = cmdline
		}
	}
	return out
}

func TestHarnessBuildAndPlugin(t *testing.T) {
	testutil.NoLeaks(t)
	const pkg = "./test/testutil/testdata/fakeplugin"
	start := time.Now()
	bin, err := testutil.BuildOnce(pkg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s in %v", bin, time.Since(start).Round(time.Millisecond))
	if again, err := testutil.BuildOnce(pkg); err != nil || again != bin {
		t.Errorf("second BuildOnce: %q, %v; want %q", again, err, bin)
	}
	if !strings.HasPrefix(bin, testutil.BinDir()) || filepath.Base(bin) != "fakeplugin" {
		t.Errorf("binary at %s, want %s/…/fakeplugin", bin, testutil.BinDir())
	}
	if _, err := testutil.BuildOnce("./test/testutil/testdata/nosuchpackage"); err == nil {
		t.Error("BuildOnce of a missing package succeeded")
	}

	p := testutil.StartPlugin(t, bin, "--node-id", "harness-node")
	if !strings.HasPrefix(p.Endpoint, "unix:///") || len(p.Socket) > 100 {
		t.Errorf("endpoint %q", p.Endpoint)
	}
	conn, err := net.Dial("unix", p.Socket)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if b, err := os.ReadFile(filepath.Join(p.StateDir, "node-id")); err != nil || string(b) != "harness-node" {
		t.Errorf("--node-id from args did not replace the default: %q, %v", b, err)
	}

	first := p.PID()
	p.Kill9()
	if p.Running() {
		t.Fatal("plugin still running after Kill9")
	}
	p.Restart()
	if !p.Running() || p.PID() == first {
		t.Fatalf("after Restart: running %v, pid %d (was %d)", p.Running(), p.PID(), first)
	}
	if n := strings.Count(p.Log(), "=== start "); n != 2 {
		t.Errorf("log shows %d starts, want 2:\n%s", n, p.Log())
	}
	if err := p.Stop(); err != nil {
		t.Errorf("Stop: %v", err)
	}
	if _, err := os.Stat(p.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after a clean stop: %v", err)
	}
}
