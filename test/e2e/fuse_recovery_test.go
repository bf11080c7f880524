package e2e

// FUSE supervision beyond a daemon that exits (issue 4, "Lifecycle"): a
// daemon that stops answering is detected by probes with deadlines and
// replaced, while NodeGetVolumeStats never hangs; a daemon that died while
// the plugin was down is restarted by the next plugin and its consumers
// healed; what lies under the state dir without a record is torn down.

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/test/testutil"
)

// fuseSquashVolume builds a squashfs image under the env's root and returns
// the context of a squashfuse volume over it.
func fuseSquashVolume(t *testing.T, e *fuseEnv, name string) map[string]string {
	t.Helper()
	testutil.RequireCommands(t, "mksquashfs", "squashfuse")
	src := filepath.Join(e.dir, name+"-src")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "hello.txt"), []byte("from squashfs\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(e.squashRoot, name+".sqfs")
	if out, err := exec.Command("mksquashfs", src, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
		t.Fatalf("mksquashfs: %v: %s", err, out)
	}
	return map[string]string{"type": "fuse", "profile": "squashfuse", "source": img}
}

// fuseCat reads a file in a child process with a deadline, so that a hung
// FUSE mount cannot hang the test.
func fuseCat(p string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "cat", p).Output()
	return string(out), err
}

func fuseRequireFuse(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireFile(t, "/dev/fuse", "the FUSE device")
}

// TestFuseHungDaemon stops the daemon (SIGSTOP): it neither exits nor
// answers. Stats answer within their deadline; the supervisor's probe
// finds requests waiting, aborts the connection (blocked callers return),
// kills the daemon and starts a new one, and re-attaches the kubelet
// publish in place.
func TestFuseHungDaemon(t *testing.T) {
	fuseRequireFuse(t)
	testutil.NoLeaks(t)
	e := startFuseEnv(t, "--fuse-probe-interval=200ms", "--fuse-probe-timeout=1s")
	id := "fuse-hung"
	if err := e.tryStage(id, mountCap("", rwo), fuseSquashVolume(t, e, "hung"), nil); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e.dir, "pods", "target")
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.NodePublishVolume(e.ctx(), &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id),
		TargetPath: target, VolumeCapability: mountCap("", rwo)}); err != nil {
		t.Fatal(err)
	}
	if out, err := fuseCat(filepath.Join(target, "hello.txt")); err != nil || out != "from squashfs\n" {
		t.Fatalf("reading the publish: %q, %v", out, err)
	}
	if _, err := e.node.NodeGetVolumeStats(e.ctx(), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target}); err != nil {
		t.Errorf("stats of a serving volume: %v", err)
	}
	first := e.daemon(id)
	if err := syscall.Kill(first.PID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	// kill -9 works on a stopped process: the test cleans up in any case.
	t.Cleanup(func() { _ = syscall.Kill(first.PID, syscall.SIGKILL) })

	t0 := time.Now()
	_, err := e.node.NodeGetVolumeStats(e.ctx(), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
	took := time.Since(t0)
	t.Logf("NodeGetVolumeStats on the hung daemon: %v after %v", err, took.Round(time.Millisecond))
	if err == nil || took > 3*time.Second {
		t.Errorf("NodeGetVolumeStats on a hung daemon: %v after %v; want an error within its 2s deadline", err, took)
	} else if c := status.Code(err); c != codes.Unavailable {
		t.Errorf("NodeGetVolumeStats on a hung daemon: code %v, want Unavailable", c)
	}

	var abnormal string
	healed := testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		if h, err := e.health(id); err == nil && h != "" && abnormal == "" {
			abnormal = h
		}
		out, err := fuseCat(filepath.Join(target, "hello.txt"))
		return err == nil && out == "from squashfs\n"
	})
	if !healed {
		t.Fatalf("the publish did not serve again within 10s of the daemon hanging")
	}
	t.Logf("hung daemon replaced and the publish healed %v after SIGSTOP; health meanwhile: %s", time.Since(stopped).Round(time.Millisecond), abnormal)
	if !strings.Contains(abnormal, "DaemonHung") && !strings.Contains(abnormal, "Reattaching") && !strings.Contains(abnormal, "DaemonDown") {
		t.Errorf("health while hung: %q, want an abnormal condition", abnormal)
	}
	second := e.daemon(id)
	if second.PID == first.PID || second.Generation != 2 || !fuseAlive(second) {
		t.Errorf("after the hang the journal records %+v", second)
	}
	if testutil.Poll(5*time.Second, 20*time.Millisecond, func() bool { return !fuseAlive(first) }) == false {
		t.Errorf("the hung daemon %d still runs", first.PID)
	}
	if !testutil.Poll(5*time.Second, 20*time.Millisecond, func() bool { h, err := e.health(id); return err == nil && h == "" }) {
		t.Error("health did not return to normal")
	}
	if _, err := e.node.NodeGetVolumeStats(e.ctx(), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target}); err != nil {
		t.Errorf("stats after the heal: %v", err)
	}
	if _, err := e.node.NodeUnpublishVolume(e.ctx(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	e.unstage(id)
	e.checkClean(id)
}

// TestFuseRepairAndOrphans: while the plugin is down, one volume's daemon
// dies (its record stays) and another volume's record is lost (its daemon
// stays). The restarted plugin restarts the first daemon and heals its
// consumer, and tears the second down: connection aborted, mount gone,
// daemon killed, directory removed.
func TestFuseRepairAndOrphans(t *testing.T) {
	fuseRequireFuse(t)
	testutil.RequireCommands(t, "nsenter", "unshare")
	testutil.NoLeaks(t)
	ns := testutil.StartUnshare(t) // before any FUSE mount: it holds no copy of one
	e := startFuseEnv(t)
	repaired, orphan := "fuse-repaired", "fuse-orphan"
	if err := e.tryStage(repaired, mountCap("", rwo), fuseSquashVolume(t, e, "repaired"), nil); err != nil {
		t.Fatal(err)
	}
	if err := e.tryStage(orphan, mountCap("", rwo), fuseSquashVolume(t, e, "orphan"), nil); err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(e.dir, "consumer")
	e.mustSidecarMount(repaired, ns.PID, mp)
	if out, err := ns.Exec(t, "cat", filepath.Join(mp, "hello.txt")); err != nil || out != "from squashfs\n" {
		t.Fatalf("consumer: %q, %v", out, err)
	}
	dead, lost := e.daemon(repaired), e.daemon(orphan)

	e.plugin.Kill9()
	if err := syscall.Kill(dead.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(e.plugin.StateDir, "volumes", orphan+".json")); err != nil {
		t.Fatal(err)
	}
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool { return !fuseAlive(dead) }) {
		t.Fatal("the killed daemon did not exit")
	}
	if _, err := ns.Exec(t, "cat", filepath.Join(mp, "hello.txt")); err == nil {
		t.Fatal("the consumer still reads through a dead daemon's mount")
	}
	e.plugin.Restart()
	e.waitReady()

	// The orphan: gone without anyone asking.
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		_, err := os.Lstat(e.volDir(orphan))
		return os.IsNotExist(err) && !fuseAlive(lost)
	}) {
		t.Errorf("the orphaned volume was not torn down: daemon alive %t", fuseAlive(lost))
	}
	e.checkClean(orphan)

	// The repaired volume: a new daemon, and the consumer reads again.
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		out, err := ns.Exec(t, "cat", filepath.Join(mp, "hello.txt"))
		return err == nil && out == "from squashfs\n"
	}) {
		t.Fatal("the consumer of the repaired volume does not read again")
	}
	d := e.daemon(repaired)
	if d.PID == dead.PID || d.Generation != 2 || !fuseAlive(d) {
		t.Errorf("repaired volume's daemon: %+v", d)
	}
	if !testutil.Poll(5*time.Second, 20*time.Millisecond, func() bool { h, err := e.health(repaired); return err == nil && h == "" }) {
		h, err := e.health(repaired)
		t.Errorf("health of the repaired volume: %q, %v", h, err)
	}
	e.mustSidecarUnmount(repaired, ns.PID, mp)
	e.unstage(repaired)
	e.checkClean(repaired)
}
