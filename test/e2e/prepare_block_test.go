package e2e

// Raw block access through the prepare flow: the plan binds the loop
// device's node onto a file inside the container; the container writes the
// device with busybox dd, and the host reads the bytes back from the image.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// prepAllowDevice lets the container open dev through its device cgroup
// (cgroup v1, the hierarchy this machine's runc uses), as a runtime does for
// a block device it is given at creation. It reports false when there is no
// such cgroup to write to.
func prepAllowDevice(t *testing.T, ctrd *testutil.Containerd, id string, dev prepDev) bool {
	t.Helper()
	f := filepath.Join("/sys/fs/cgroup/devices", ctrd.Namespace, id, "devices.allow")
	if _, err := os.Stat(f); err != nil {
		return false
	}
	if err := os.WriteFile(f, []byte(fmt.Sprintf("b %d:%d rw", dev.Major, dev.Minor)), 0o644); err != nil {
		t.Fatalf("allowing %s in %s: %v", dev, f, err)
	}
	return true
}

func TestPrepareBlock(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter")
	testutil.NoLeaks(t)
	tm := prepTimer(t)
	ctrd := testutil.StartContainerd(t)
	e := startEnv(t, envOptions{})

	id := e.createFor("prep-block", 16*miB, blockCap(rwo)).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, blockCap(rwo), nil)
	dev := e.stagedDevice(id, image)
	if st := e.loopState(id); st.FsType != "" {
		t.Errorf("a block volume was formatted: %q", st.FsType)
	}
	watch := prepDevWatch(t, dev)
	c := ctrd.Run(t, "blk", testutil.BusyboxRootfs(t), "sleep", "3600")
	tm.step("block volume staged on " + dev.String() + ", container running")

	// A volume staged for block access refuses a filesystem plan, and the
	// failed attempt leaves no claim.
	if out, code := e.sidecarMount(id, c.PID(), "/data"); code == 0 {
		t.Errorf("mount access to a block-staged volume succeeded:\n%s", out)
	}
	e.wantNoConsumer(id)

	const target = "/dev/mpvol"
	e.mustSidecarMount(id, c.PID(), target, "--block")
	cons := e.wantConsumer(id, c.PID(), target)
	if len(cons.Mounts) != 1 || cons.Mounts[0].Type != "bind" || cons.Mounts[0].Source != dev.Path ||
		!cons.Mounts[0].HasOption("nosuid") || cons.Mounts[0].HasOption("nodev") {
		t.Errorf("block plan %v, want one bind of %s, nosuid without nodev", cons.Mounts, dev.Path)
	}
	// Inside: a device-node bind on a file, the loop device's number.
	out, err := c.Exec(t, "stat", "-c", "%F %t:%T", target)
	if want := fmt.Sprintf("block special file %x:%x\n", dev.Major, dev.Minor); err != nil || out != want {
		t.Errorf("stat %s inside: %q, %v; want %q", target, out, err, want)
	}
	if mi := prepMountAt(t, c.PID(), target); mi == nil || mi.Root != "/"+dev.name() {
		t.Errorf("mount at %s inside: %+v; want a bind of the node %s", target, mi, dev.Path)
	}
	prepCheckHostClean(t, "after the block mount", dev)
	tm.step("device node bound at " + target + " inside the container")

	// A container may open only the devices its cgroup allows; a runtime
	// allows the ones it is given at creation. The sidecar binds the node
	// later and does not touch the cgroup: without this, dd fails with EPERM.
	const offset = 1 << 20
	pattern := bytes.Repeat([]byte("mountplan block\n"), 4096/16)
	write := fmt.Sprintf("yes 'mountplan block' | head -c 4096 > /tmp/pat && dd if=/tmp/pat of=%s bs=4096 seek=%d count=1 conv=notrunc,fsync 2>&1", target, offset/4096)
	if out, err := c.Exec(t, "sh", "-c", write); err != nil {
		if !strings.Contains(err.Error()+out, "Operation not permitted") || !prepAllowDevice(t, ctrd, c.ID, dev) {
			t.Fatalf("dd inside the container: %v\n%s", err, out)
		}
		t.Logf("dd without a device cgroup rule: %v; allowed %s in the container's device cgroup, as a runtime would", strings.TrimSpace(out), dev)
		if out, err := c.Exec(t, "sh", "-c", write); err != nil {
			t.Fatalf("dd inside the container: %v\n%s", err, out)
		}
	}
	// Read it back on the host through the image file, and inside through the node.
	f, err := os.Open(image)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(pattern))
	_, err = f.ReadAt(got, offset)
	f.Close()
	if err != nil || !bytes.Equal(got, pattern) {
		t.Errorf("image at %d: %q..., %v; want the pattern dd wrote", offset, got[:32], err)
	}
	if out, err := c.Exec(t, "sh", "-c", fmt.Sprintf("dd if=%s bs=4096 skip=%d count=1 2>/dev/null | head -c 16", target, offset/4096)); err != nil || out != "mountplan block\n" {
		t.Errorf("reading the device back inside: %q, %v", out, err)
	}
	prepCheckHostClean(t, "after writing the device", dev)
	tm.step("written with dd inside, read back from the image on the host")

	e.mustSidecarUnmount(id, c.PID(), target)
	if mi := prepMountAt(t, c.PID(), target); mi != nil {
		t.Errorf("after unmount %s is still a mount inside", target)
	}
	e.wantNoConsumer(id)
	e.unstage(id)
	waitNoLoop(t, image)
	e.delete(id)
	watch.check(t, dev.String()+" mounted")
	tm.step("unmounted, unstaged, deleted")
}
