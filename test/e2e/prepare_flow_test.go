package e2e

// The prepare-not-publish flow end to end (issue 3, "Proof"): the plugin
// stages a loop volume and answers NodePrepareVolume with a plan;
// mountplan-sidecar, run as a subprocess as hack/demo.sh runs it, performs
// the plan inside a consumer's mount namespace (a real container's, or one
// from unshare), and the host's mount namespace never sees the volume.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// prepCheckPluginInHostNS makes sure the plugin runs in the test's (the
// host's) mount namespace, so that the test's /proc/self/mountinfo is the
// table in which nothing of a prepared volume may appear.
func prepCheckPluginInHostNS(t *testing.T, e *env) {
	t.Helper()
	self, err := testutil.MountNamespaceOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if ns, err := testutil.MountNamespaceOf(e.plugin.PID()); err != nil || ns != self {
		t.Fatalf("plugin in mount namespace %q (%v), the test in %s", ns, err, self)
	}
}

// prepCheckMountedIn checks that pid's namespace has the filesystem of dev
// at mountPoint, mounted nosuid,nodev.
func prepCheckMountedIn(t *testing.T, pid int, mountPoint, fsType string, dev prepDev) {
	t.Helper()
	mi := prepMountAt(t, pid, mountPoint)
	if mi == nil {
		t.Fatalf("nothing mounted at %s in the namespace of pid %d", mountPoint, pid)
	}
	if mi.FSType != fsType || uint32(mi.Major) != dev.Major || uint32(mi.Minor) != dev.Minor {
		t.Errorf("at %s in pid %d's namespace: %s %d:%d, want %s on %s", mountPoint, pid, mi.FSType, mi.Major, mi.Minor, fsType, dev)
	}
	for _, o := range []string{"nosuid", "nodev"} {
		if !strings.Contains(","+mi.Options+",", ","+o+",") {
			t.Errorf("mount at %s in pid %d's namespace lacks %s: %s", mountPoint, pid, o, mi.Options)
		}
	}
}

func TestPrepareInContainers(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter")
	testutil.NoLeaks(t)
	tm := prepTimer(t)
	ctrd := testutil.StartContainerd(t)
	e := startEnv(t, envOptions{})
	prepCheckPluginInHostNS(t, e)
	tm.step("containerd and plugin running")

	id := e.create("prep-containers", "", 64*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)
	watch := prepDevWatch(t, dev)
	prepCheckHostClean(t, "after NodeStageVolume", dev)
	tm.step("volume " + id + " staged on " + dev.String())

	const target = "/data"
	rootA := testutil.BusyboxRootfs(t)
	a := ctrd.Run(t, "a", rootA, "sleep", "3600")
	e.mustSidecarMount(id, a.PID(), target)
	prepCheckHostClean(t, "after mounting into container A", dev)
	consA := e.wantConsumer(id, a.PID(), target)
	prepCheckMountedIn(t, a.PID(), target, "ext4", dev)
	tm.step(fmt.Sprintf("mounted in container A (pid %d, mnt ns %d)", a.PID(), consA.Namespace.Inode))

	out, err := a.Exec(t, "sh", "-c", "echo 'hello from A' > /data/hello.txt && sync && cat /data/hello.txt && grep ' /data ' /proc/self/mountinfo")
	if err != nil {
		t.Fatalf("writing from inside A: %v", err)
	}
	if !strings.HasPrefix(out, "hello from A\n") || !strings.Contains(out, fmt.Sprintf(" %d:%d ", dev.Major, dev.Minor)) {
		t.Errorf("inside A: %q; want the file back and /data on %s", out, dev)
	}
	// The directory under the mount, on the host, stays empty.
	if _, err := os.Stat(filepath.Join(rootA, "data", "hello.txt")); err == nil {
		t.Error("the file written inside A is visible on the host under A's rootfs")
	}
	prepCheckHostClean(t, "after writing from inside A", dev)

	// A live consumer keeps the volume staged.
	err = e.tryUnstage(id)
	testutil.WantCode(t, "NodeUnstageVolume while A uses the volume", err, codes.FailedPrecondition, fmt.Sprintf("pid %d", a.PID()))
	if e.stagedDevice(id, image) != dev {
		t.Fatal("the refused unstage changed the device")
	}

	e.mustSidecarUnmount(id, a.PID(), target)
	if mi := prepMountAt(t, a.PID(), target); mi != nil {
		t.Errorf("after unmount, A still has %s at %s", mi.FSType, target)
	}
	e.wantNoConsumer(id)
	prepCheckHostClean(t, "after unmounting from A", dev)
	if out, err := a.Exec(t, "ls", "-A", "/data"); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("A's /data after unmount: %q, %v; want an empty directory", out, err)
	}
	tm.step("unmounted from A")

	rootB := testutil.BusyboxRootfs(t)
	b := ctrd.Run(t, "b", rootB, "sleep", "3600")
	e.mustSidecarMount(id, b.PID(), target)
	consB := e.wantConsumer(id, b.PID(), target)
	prepCheckMountedIn(t, b.PID(), target, "ext4", dev)
	if out, err := b.Exec(t, "cat", "/data/hello.txt"); err != nil || out != "hello from A\n" {
		t.Errorf("reading A's file inside B: %q, %v", out, err)
	}
	prepCheckHostClean(t, "after mounting into container B", dev)
	showing := prepNamespacesShowing(dev)
	if len(showing) != 1 || showing[b.MountNS()] == 0 {
		t.Errorf("mount namespaces showing %s: %v; want only B's %s", dev, showing, b.MountNS())
	}
	tm.step(fmt.Sprintf("mounted in container B (pid %d), A's file read back", b.PID()))

	// Kill B without unmounting: its namespace, and the mount in it, die with it.
	pidB := b.PID()
	b.Kill(t)
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool { return len(prepNamespacesShowing(dev)) == 0 }) {
		t.Errorf("after B was killed, mount namespaces still show %s: %v", dev, prepNamespacesShowing(dev))
	}
	// The device itself stays: the plugin holds it while the volume is staged.
	if got := loopBackingFile(dev.name()); got != image {
		t.Errorf("after B was killed, %s is backed by %q, want %q (still staged)", dev, got, image)
	}
	// Nothing has told the plugin yet: the journal still names B (the
	// periodic reconciler runs every minute).
	if cs := e.consumers(id); len(cs) != 1 || cs[0].PID != pidB {
		t.Errorf("journal consumers after B died, before any call: %+v; want B's (pid %d)", cs, pidB)
	}
	tm.step("container B killed; its mounts are gone")

	// NodeUnstageVolume drops consumers whose namespace is gone before it
	// decides, so B's dead claim does not block it.
	e.unstage(id)
	if v := e.mustRecord(id); v.Stage != nil || len(v.Consumers) != 0 {
		t.Errorf("journal after unstage: stage %+v, consumers %+v", v.Stage, v.Consumers)
	}
	waitNoLoop(t, image)
	// Releasing B afterwards is idempotent, as is a second unstage.
	if err := e.unprepare(id, pidB, target, consB.Namespace.Inode); err != nil {
		t.Errorf("NodeUnprepareVolume for dead B after unstage: %v", err)
	}
	if err := e.unprepare(id, pidB, target, 0); err != nil {
		t.Errorf("NodeUnprepareVolume for dead B by PID only: %v", err)
	}
	// So is the sidecar's unmount of a consumer that is gone.
	e.mustSidecarUnmount(id, pidB, target)
	e.unstage(id)
	e.delete(id)
	e.noRecord(id)
	if _, err := os.Stat(image); err == nil {
		t.Errorf("image %s left after DeleteVolume", image)
	}
	watch.check(t, dev.String()+" mounted")
	tm.step("unstaged and deleted")
}

func TestPrepareUnshare(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	tm := prepTimer(t)
	e := startEnv(t, envOptions{})
	prepCheckPluginInHostNS(t, e)

	id := e.create("prep-unshare", "", 32*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)
	watch := prepDevWatch(t, dev)
	tm.step("volume staged on " + dev.String())

	ns := testutil.StartUnshare(t)
	// The namespace is a private copy of the host's tree: the target is a
	// host directory, and the mount must stay on the namespace's side.
	target := filepath.Join(e.dir, "consumer")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	e.mustSidecarMount(id, ns.PID, target)
	cons := e.wantConsumer(id, ns.PID, target)
	prepCheckMountedIn(t, ns.PID, target, "ext4", dev)
	prepCheckHostClean(t, "after mounting into the unshare namespace", dev)
	// A repeated mount is a no-op: one claim, one mount.
	e.mustSidecarMount(id, ns.PID, target)
	e.wantConsumer(id, ns.PID, target)
	if m, _ := prepMountsOfDev(ns.PID, dev); len(m) != 1 {
		t.Errorf("after a repeated mount the namespace shows %s %d times: %v", dev, len(m), m)
	}
	if mi := prepMountAt(t, os.Getpid(), target); mi != nil {
		t.Errorf("the host has a mount at %s: %s %s", target, mi.FSType, mi.Source)
	}
	tm.step(fmt.Sprintf("mounted in pid %d's namespace (mnt ns %d)", ns.PID, cons.Namespace.Inode))

	if _, err := ns.Exec(t, "sh", "-c", "echo 'inside' > "+target+"/f && sync"); err != nil {
		t.Fatal(err)
	}
	if out, err := ns.Exec(t, "cat", target+"/f"); err != nil || out != "inside\n" {
		t.Errorf("reading back inside the namespace: %q, %v", out, err)
	}
	if _, err := os.Stat(filepath.Join(target, "f")); err == nil {
		t.Error("the file written inside the namespace is visible on the host")
	}

	// The live consumer blocks unstage, by name; the journal keeps it.
	err := e.tryUnstage(id)
	testutil.WantCode(t, "NodeUnstageVolume while the namespace uses the volume", err, codes.FailedPrecondition,
		fmt.Sprintf("pid %d", ns.PID), fmt.Sprint(cons.Namespace.Inode), target)
	e.wantConsumer(id, ns.PID, target)
	if got := loopBackingFile(dev.name()); got != image {
		t.Errorf("the refused unstage detached %s (backing file now %q)", dev, got)
	}
	// A repeated prepare for the same consumer gets the same answer and
	// records no second claim.
	resp, err := e.prepare(id, mountCap("", rwo), ns.PID, target)
	if err != nil {
		t.Fatalf("repeated NodePrepareVolume: %v", err)
	}
	if got := resp.GetConsumer().GetMntNsInode(); got != cons.Namespace.Inode {
		t.Errorf("repeated NodePrepareVolume: mnt ns %d, want %d", got, cons.Namespace.Inode)
	}
	if ms := resp.GetMounts(); len(ms) != 1 || ms[0].GetType() != "ext4" || ms[0].GetSource() != dev.Path {
		t.Errorf("plan %v, want one ext4 mount of %s", ms, dev.Path)
	}
	e.wantConsumer(id, ns.PID, target)
	tm.step("unstage refused while the consumer lives")

	// A busy mount cannot be unmounted: the sidecar fails and the claim is kept.
	busy := exec.Command("nsenter", "-t", fmt.Sprint(ns.PID), "-m", "sh", "-c", "cd "+target+" && exec sleep 60")
	if err := busy.Start(); err != nil {
		t.Fatal(err)
	}
	busyDone := make(chan struct{})
	go func() { _ = busy.Wait(); close(busyDone) }()
	t.Cleanup(func() { _ = busy.Process.Kill(); <-busyDone })
	if !testutil.Poll(5*time.Second, 5*time.Millisecond, func() bool {
		// Its working directory is on the volume's filesystem.
		var st unix.Stat_t
		return unix.Stat(fmt.Sprintf("/proc/%d/cwd", busy.Process.Pid), &st) == nil &&
			unix.Major(uint64(st.Dev)) == dev.Major && unix.Minor(uint64(st.Dev)) == dev.Minor //nolint:unconvert
	}) {
		t.Fatal("the busy process did not enter the mount")
	}
	if out, code := e.sidecarUnmount(id, ns.PID, target); code != 1 || !strings.Contains(out, "busy") {
		t.Errorf("unmount of a busy mount: exit %d, want 1 naming the busy mount:\n%s", code, out)
	}
	e.wantConsumer(id, ns.PID, target)
	prepCheckMountedIn(t, ns.PID, target, "ext4", dev)
	_ = busy.Process.Kill()
	<-busyDone

	e.mustSidecarUnmount(id, ns.PID, target)
	if mi := prepMountAt(t, ns.PID, target); mi != nil {
		t.Errorf("after unmount the namespace still has %s at %s", mi.FSType, target)
	}
	e.wantNoConsumer(id)
	// Unmount again: nothing mounted, nothing claimed; still success.
	e.mustSidecarUnmount(id, ns.PID, target)
	e.unstage(id)
	waitNoLoop(t, image)
	e.delete(id)
	if _, err := os.Stat(target); err != nil {
		t.Errorf("the consumer's own directory %s was removed: %v", target, err)
	}
	ns.Kill()
	watch.check(t, dev.String()+" mounted")
	tm.step("unmounted, unstaged, deleted")
}
