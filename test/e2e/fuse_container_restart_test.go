package e2e

// A restart of the plugin's container must not take a FUSE mount down
// (issue 4). In Kubernetes a container restart kills every process of the
// container's cgroup, so the daemons must not live there: with
// --mounter-endpoint the plugin has `mountplan-sidecar serve` start them
// (StartDaemon), in the sidecar's container. The test simulates the two
// containers with two cgroups, "restarts" the plugin's by killing every
// process in its cgroup and starting a new plugin there, while a consumer
// container keeps reading through its mount. The negative control shows
// the daemon in the plugin's cgroup when the plugin starts it itself.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/test/testutil"
)

func TestFuseContainerRestart(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter", "squashfuse", "mksquashfs")
	testutil.RequireFile(t, "/dev/fuse", "the FUSE device")
	t.Run("daemons in the sidecar", fuseContainerRestart)
	t.Run("daemons in the plugin", fuseLocalSpawnerCgroup)
}

func fuseContainerRestart(t *testing.T) {
	testutil.NoLeaks(t)
	start := time.Now()
	step := func(what string) { t.Logf("== %s (at %v)", what, time.Since(start).Round(time.Millisecond)) }
	plugCg, sideCg := fuseCgroups(t)
	ctrd := testutil.StartContainerd(t)
	ctr := ctrd.Run(t, "consumer", testutil.BusyboxRootfs(t), "sleep", "3600")
	e := newFuseEnv(t, "")
	e.startMounter(sideCg)
	e.startPlugin(plugCg, "--v=5")
	fuseWantInCgroup(t, "the sidecar", e.mounter.pid(), sideCg, plugCg)
	fuseWantInCgroup(t, "the plugin", e.plugin.PID(), plugCg, sideCg)
	vctx := fuseSquashVolume(t, e, "ctr-restart")
	step("containerd, consumer, sidecar and plugin (each in its own cgroup) running")

	const id, target = "fuse-ctr-restart", "/data"
	if err := e.tryStage(id, mountCap("", rwo), vctx, nil); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	d := e.state(id).Daemon
	if !fuseAlive(d) || d.Conn == 0 {
		t.Fatalf("after stage the journal records daemon %+v; want a live one with a connection", d)
	}
	fuseWantInCgroup(t, "the daemon", d.PID, sideCg, plugCg)
	if pp := fusePPid(d.PID); pp != e.mounter.pid() {
		t.Errorf("the daemon's parent is pid %d, want the sidecar %d", pp, e.mounter.pid())
	}
	if l := e.mounter.log(); !strings.Contains(l, fmt.Sprintf("pid=%d ", d.PID)) || !strings.Contains(l, `"Started daemon"`) {
		t.Errorf("the sidecar's log does not show it started pid %d:\n%s", d.PID, l)
	}
	e.mustSidecarMount(id, ctr.PID(), target)
	const want = "from squashfs\n"
	if out, err := testutil.Exec(t, ctr.PID(), "cat", target+"/hello.txt"); err != nil || out != want {
		t.Fatalf("reading inside the container: %q, %v", out, err)
	}
	step(fmt.Sprintf("staged, daemon pid %d in the sidecar's cgroup; mounted in the container", d.PID))

	// The consumer reads through its mount the whole time.
	r := fuseStartReader(ctr.PID(), target+"/hello.txt", want)

	// "Restart the plugin's container": kill every process of its cgroup,
	// then start a new plugin in it.
	killed := fuseKillCgroup(t, plugCg)
	if !slices.Contains(killed, e.plugin.PID()) {
		t.Errorf("killing the plugin's cgroup did not kill the plugin (killed %v)", killed)
	}
	if slices.Contains(killed, d.PID) {
		t.Errorf("killing the plugin's cgroup killed the daemon")
	}
	if !e.plugin.Exited(10 * time.Second) {
		t.Fatal("the plugin still runs 10s after its cgroup was emptied")
	}
	time.Sleep(200 * time.Millisecond) // reads while no plugin runs
	if !fuseAlive(d) {
		t.Fatalf("daemon %s died with the plugin's container", d.Proc)
	}
	reads := r.count()
	step(fmt.Sprintf("plugin's cgroup emptied (killed %v); the daemon runs", killed))
	e.plugin.Restart()
	e.waitReady()
	fuseWantInCgroup(t, "the restarted plugin", e.plugin.PID(), plugCg, sideCg)
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool { return e.state(id).Daemon.PID == d.PID }) {
		t.Errorf("after the restart the journal records daemon %+v, want pid %d", e.state(id).Daemon, d.PID)
	}
	if got := e.daemon(id); got.PID != d.PID || got.Generation != 1 {
		t.Errorf("the restarted plugin started another daemon: %+v", got)
	}
	if ps := e.volumeDaemons(id, vctx); len(ps) != 1 {
		t.Errorf("want exactly one daemon for the volume after adoption, got %v", ps)
	}
	if h, err := e.health(id); err != nil || h != "" {
		t.Errorf("health after adoption: %q, %v", h, err)
	}
	time.Sleep(200 * time.Millisecond)
	n, failures := r.stop()
	if n <= reads {
		t.Errorf("the consumer did not read after the plugin was gone (%d reads before, %d in all)", reads, n)
	}
	for _, f := range failures {
		t.Errorf("a read inside the container failed: %s", f)
	}
	t.Logf("the consumer read %d times while the plugin's container was restarted, every one successful", n)
	fuseWantInCgroup(t, "the daemon", d.PID, sideCg, plugCg)
	fuseCheckBind(t, ctr.PID(), target, d.Conn)
	step(fmt.Sprintf("plugin restarted in its cgroup; daemon pid %d adopted", d.PID))

	e.mustSidecarUnmount(id, ctr.PID(), target)
	e.unstage(id)
	if fuseAlive(d) {
		t.Errorf("daemon %d still runs after unstage", d.PID)
	}
	e.checkClean(id)
	if _, err := e.record(id); err == nil {
		t.Errorf("the static volume's record outlived its unstage")
	}
	step("unmounted and unstaged; nothing left")
}

// fuseLocalSpawnerCgroup is the negative control: without a mounter, the
// plugin starts the daemon itself and it lands in the plugin's cgroup,
// where a container restart kills it.
func fuseLocalSpawnerCgroup(t *testing.T) {
	testutil.NoLeaks(t)
	plugCg, otherCg := fuseCgroups(t)
	e := newFuseEnv(t, "")
	e.startPlugin(plugCg, "--v=5")
	vctx := fuseSquashVolume(t, e, "local")
	const id = "fuse-local-spawner"
	if err := e.tryStage(id, mountCap("", rwo), vctx, nil); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	d := e.state(id).Daemon
	fuseWantInCgroup(t, "the daemon of a plugin without a mounter", d.PID, plugCg, otherCg)
	killed := fuseKillCgroup(t, plugCg)
	if !slices.Contains(killed, d.PID) || fuseAlive(d) {
		t.Errorf("emptying the plugin's cgroup left the daemon %s running (killed %v)", d.Proc, killed)
	}
	if !e.plugin.Exited(10 * time.Second) {
		t.Fatal("the plugin still runs 10s after its cgroup was emptied")
	}
	t.Logf("emptying the plugin's cgroup killed the plugin and the daemon: %v", killed)
	e.plugin.Restart()
	e.waitReady()
	e.unstage(id)
	e.checkClean(id)
}

// fuseCgroups makes two sibling cgroups, one per simulated container, in
// the first hierarchy that lets it: the cgroup v2 one (unified, mounted on
// /sys/fs/cgroup/unified on hybrid machines or on /sys/fs/cgroup), or the
// v1 pids or freezer one. A cleanup empties and removes them.
func fuseCgroups(t *testing.T) (a, b string) {
	t.Helper()
	var parent string
	for _, root := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/freezer"} {
		if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err != nil {
			continue
		}
		dir, err := os.MkdirTemp(root, "mountplan-e2e-")
		if err != nil {
			continue
		}
		parent = dir
		break
	}
	if parent == "" {
		testutil.Missing(t, "a cgroup hierarchy where a child cgroup can be made")
	}
	a, b = filepath.Join(parent, "plugin"), filepath.Join(parent, "sidecar")
	t.Cleanup(func() {
		for _, cg := range []string{a, b, parent} {
			if killed := fuseKillCgroup(t, cg); len(killed) > 0 {
				t.Errorf("processes left in %s: %v", cg, killed)
			}
			var err error
			testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
				err = os.Remove(cg)
				return err == nil || errors.Is(err, os.ErrNotExist)
			})
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("removing cgroup %s: %v", cg, err)
			}
		}
	})
	for _, cg := range []string{a, b} {
		if err := os.Mkdir(cg, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("cgroups %s and %s", a, b)
	return a, b
}

// fuseCgroupProcs lists the processes of a cgroup.
func fuseCgroupProcs(cg string) []int {
	b, err := os.ReadFile(filepath.Join(cg, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// fuseKillCgroup kills every process of cg, as a container runtime does
// when a container stops: SIGKILL to each, again, until none is left.
func fuseKillCgroup(t *testing.T, cg string) (killed []int) {
	t.Helper()
	ok := testutil.Poll(10*time.Second, 10*time.Millisecond, func() bool {
		ps := fuseCgroupProcs(cg)
		for _, pid := range ps {
			if syscall.Kill(pid, syscall.SIGKILL) == nil && !slices.Contains(killed, pid) {
				killed = append(killed, pid)
			}
		}
		return len(ps) == 0
	})
	if !ok {
		t.Errorf("processes of %s still there after 10s of SIGKILL: %v", cg, fuseCgroupProcs(cg))
	}
	return killed
}

// fuseWantInCgroup checks that pid is in cgroup in and not in notIn.
func fuseWantInCgroup(t *testing.T, what string, pid int, in, notIn string) {
	t.Helper()
	if !slices.Contains(fuseCgroupProcs(in), pid) {
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		t.Errorf("%s (pid %d) is not in cgroup %s; /proc/%d/cgroup:\n%s", what, pid, in, pid, cg)
	}
	if slices.Contains(fuseCgroupProcs(notIn), pid) {
		t.Errorf("%s (pid %d) is in cgroup %s", what, pid, notIn)
	}
}

// fusePPid returns the parent of pid (0 when unknown).
func fusePPid(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "PPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// fuseReader reads a file inside a container's mount namespace in a loop
// until stopped, and keeps what failed.
type fuseReaderLoop struct {
	mu       sync.Mutex
	n        int
	failures []string
	cancel   context.CancelFunc
	done     chan struct{}
}

func fuseStartReader(pid int, path, want string) *fuseReaderLoop {
	ctx, cancel := context.WithCancel(context.Background())
	r := &fuseReaderLoop{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		for ctx.Err() == nil {
			rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
			out, err := exec.CommandContext(rctx, "nsenter", "-t", strconv.Itoa(pid), "-m", "--", "cat", path).CombinedOutput()
			rcancel()
			if ctx.Err() != nil {
				return
			}
			r.mu.Lock()
			r.n++
			if err != nil || string(out) != want {
				r.failures = append(r.failures, fmt.Sprintf("read %d at %s: %q, %v", r.n, time.Now().Format("15:04:05.000"), out, err))
			}
			r.mu.Unlock()
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return r
}

func (r *fuseReaderLoop) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}

func (r *fuseReaderLoop) stop() (int, []string) {
	r.cancel()
	<-r.done
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n, r.failures
}
