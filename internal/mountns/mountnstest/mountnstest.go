//go:build linux

// Package mountnstest holds the fixtures that root tests of mount code share:
// a mount namespace held open by a process, loop devices over images in a
// temp dir, and a check that nothing a test mounted or attached outlives it.
package mountnstest

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// RequireRoot and RequireTool stop a test that lacks root or a command: a
// skip outside CI, a failure under CI=true (package testenv).
var (
	RequireRoot = testenv.RequireRoot
	RequireTool = testenv.RequireCommands
)

// Scratch returns a fresh temp dir and registers a check, which runs after
// every cleanup registered later, that no mount in the test's namespace lies
// under it and no loop device is backed by a file under it. Leaks fail the
// test and are then removed so that one failure does not spoil the machine.
func Scratch(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() { checkNoLeaks(t, dir) })
	return dir
}

func checkNoLeaks(t testing.TB, dir string) {
	t.Helper()
	mounts := MountsUnder(t, 0, dir)
	for i := len(mounts) - 1; i >= 0; i-- {
		t.Errorf("leaked mount: %s %s on %s", mounts[i].FSType, mounts[i].Source, mounts[i].Mountpoint)
		_ = unix.Unmount(mounts[i].Mountpoint, unix.MNT_DETACH)
	}
	for dev, backing := range loopDevices(t) {
		if plan.Within(dir, backing) {
			t.Errorf("leaked loop device %s backed by %s", dev, backing)
			_ = exec.Command("losetup", "-d", dev).Run()
		}
	}
}

// MountsUnder returns the mounts of pid's namespace (0: the test's own)
// whose mount point is dir or lies below it.
func MountsUnder(t testing.TB, pid int, dir string) []*mountinfo.Info {
	t.Helper()
	file := "/proc/thread-self/mountinfo"
	if pid != 0 {
		file = "/proc/" + strconv.Itoa(pid) + "/mountinfo"
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatalf("read %s: %v", file, err)
	}
	mounts, err := mountinfo.GetMountsFromReader(bytes.NewReader(data), func(m *mountinfo.Info) (bool, bool) {
		return !plan.Within(dir, m.Mountpoint), false
	})
	if err != nil {
		t.Fatalf("parse %s: %v", file, err)
	}
	return mounts
}

// loopDevices maps each configured loop device to its backing file, from
// sysfs (what `losetup -a` prints).
func loopDevices(t testing.TB) map[string]string {
	t.Helper()
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
		out[dev] = strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
	}
	return out
}

// Namespace starts `unshare --mount --propagation <propagation> sleep 300`
// and returns its PID once it sleeps in its new namespace. Cleanup kills it;
// the kernel drops the namespace's mounts with its last process.
func Namespace(t testing.TB, propagation string) int {
	t.Helper()
	RequireTool(t, "unshare")
	cmd := exec.Command("unshare", "--mount", "--propagation", propagation, "sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start unshare: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	comm := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/comm"
	// unshare execs sleep only after it has set up the namespace.
	if poll(func() bool { b, err := os.ReadFile(comm); return err == nil && string(b) == "sleep\n" }) {
		return cmd.Process.Pid
	}
	t.Fatalf("unshare did not reach sleep within 10s")
	return 0
}

// NamespaceInode returns the inode of pid's mount namespace.
func NamespaceInode(t testing.TB, pid int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/"+strconv.Itoa(pid)+"/ns/mnt", &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// LoopDevice creates an image of sizeMiB under dir, formats it with
// mkfs.<fstype> unless fstype is empty, attaches it with losetup and returns
// the device. Cleanup detaches it.
func LoopDevice(t testing.TB, dir, fstype string, sizeMiB int) string {
	t.Helper()
	RequireTool(t, "losetup")
	img, err := os.CreateTemp(dir, "img-*.raw")
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if err := img.Truncate(int64(sizeMiB) << 20); err != nil {
		t.Fatal(err)
	}
	if fstype != "" {
		RequireTool(t, "mkfs."+fstype)
		run(t, "mkfs."+fstype, mkfsArgs(fstype, img.Name())...)
	}
	return AttachLoop(t, img.Name(), false)
}

// AttachLoop attaches image to a free loop device (read-only if asked) and
// returns the device. Cleanup detaches it.
func AttachLoop(t testing.TB, image string, readOnly bool) string {
	t.Helper()
	RequireTool(t, "losetup")
	args := []string{"--find", "--show", image}
	if readOnly {
		args = append([]string{"--read-only"}, args...)
	}
	dev := strings.TrimSpace(run(t, "losetup", args...))
	t.Cleanup(func() { detachLoop(t, dev, image) })
	return dev
}

// detachLoop detaches dev and waits until it no longer serves img. The
// kernel defers the detach while anyone (udev, blkid) still has the device
// open, so the wait is part of the detach, not a timing assertion.
func detachLoop(t testing.TB, dev, img string) {
	t.Helper()
	if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
		t.Errorf("losetup -d %s: %v: %s", dev, err, out)
		return
	}
	if !poll(func() bool { return loopDevices(t)[dev] != img }) {
		t.Errorf("%s still backed by %s 10s after losetup -d", dev, img)
	}
}

func mkfsArgs(fstype, img string) []string {
	switch fstype {
	case "ext4":
		return []string{"-q", "-F", img}
	case "xfs":
		return []string{"-q", "-f", img}
	}
	return []string{img}
}

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, stderr)
	}
	return string(out)
}

// ProcStatus reads /proc/PID/status as its fields (Uid, CapEff, ...).
func ProcStatus(t testing.TB, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		out[k] = strings.TrimSpace(v)
	}
	return out
}

// CapSet is the capability set field (CapEff, CapBnd, ...) of a status
// ProcStatus read.
func CapSet(t testing.TB, status map[string]string, field string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(status[field], 16, 64)
	if err != nil {
		t.Fatalf("%s %q: %v", field, status[field], err)
	}
	return v
}

// Squashfs makes img, a squashfs image of the directory content.
func Squashfs(t testing.TB, content, img string) {
	t.Helper()
	if out, err := exec.Command("mksquashfs", content, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
		t.Fatalf("mksquashfs: %v: %s", err, out)
	}
}

// poll asks done every 5ms until it says yes, for at most 10s, and says
// whether it did.
func poll(done func() bool) bool {
	return wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) { return done(), nil }) == nil
}

// SELinuxLabel is what `stat -c %C` shows of p: its security.selinux
// attribute, without the kernel's trailing NUL.
func SELinuxLabel(t *testing.T, p string) string {
	t.Helper()
	buf := make([]byte, 256)
	n, err := unix.Getxattr(p, "security.selinux", buf)
	if err != nil {
		t.Fatalf("getxattr %s security.selinux: %v", p, err)
	}
	return strings.TrimRight(string(buf[:n]), "\x00")
}
