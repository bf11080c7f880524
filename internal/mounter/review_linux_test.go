//go:build linux

package mounter_test

// The review of 2026-12 found holes in the mounter; each test here (and
// the rows marked with a finding in TestHostileRequests) sends what used to
// get through and asserts it no longer does. Their versions against the
// code the review read failed: that was the demonstration.

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// mkdirs makes each directory (and its parents).
func mkdirs(t testing.TB, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func writeFile(t testing.TB, p, content string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// mountTmpfs mounts a tmpfs labelled label at p in the test's namespace
// until the test ends.
func mountTmpfs(t testing.TB, label, p string) {
	t.Helper()
	if err := unix.Mount(label, p, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		t.Fatalf("mount tmpfs at %s: %v", p, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
}

// bindMount binds src at dst in the test's namespace until the test ends.
func bindMount(t testing.TB, src, dst string) {
	t.Helper()
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s at %s: %v", src, dst, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
}

// devOf returns the major:minor of block device node p.
func devOf(t testing.TB, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return uint64(st.Rdev) //nolint:unconvert // Rdev is uint32 on some architectures
}

// mknodBlock makes a block device node p with device number dev; cleanup
// removes it.
func mknodBlock(t testing.TB, p string, dev uint64) {
	t.Helper()
	if err := unix.Mknod(p, unix.S_IFBLK|0o600, int(dev)); err != nil {
		t.Fatalf("mknod %s: %v", p, err)
	}
	t.Cleanup(func() { _ = os.Remove(p) })
}

// devTestDir makes a directory under /dev (device sources must lie there);
// cleanup removes it once the nodes in it are gone.
func devTestDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("/dev", "mountplan-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(d) })
	return d
}

// mountedDev is the device number of the mount on top at p in pid's
// namespace (0 when nothing is mounted there).
func mountedDev(t testing.TB, pid int, dir, p string) uint64 {
	t.Helper()
	var dev uint64
	for _, m := range mountnstest.MountsUnder(t, pid, dir) {
		if m.Mountpoint == p {
			dev = unix.Mkdev(uint32(m.Major), uint32(m.Minor))
		}
	}
	return dev
}

// undo removes what a wrongly accepted Mount attached in the consumer.
func undo(t testing.TB, e *mounter.Local, c plan.Consumer) {
	t.Helper()
	if err := e.UnmountAll(context.Background(), c); err != nil {
		t.Errorf("cleaning up the accepted plan: %v", err)
	}
}

// TestReview1bImageRoots (review finding 1b): the mounter attaches images
// itself, opened below the image root without following a symlink, and
// only regular files: the plugin's <state>/images replaced by a symlink,
// an image that is a symlink, and a block device node posing as an image
// (it would hand a container the host's disk) are all refused.
func TestReview1bImageRoots(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	state, outside := filepath.Join(dir, "state"), filepath.Join(dir, "outside")
	mkdirs(t, state, outside)
	records := filepath.Join(dir, "records")
	e := node(t, mounter.Options{StateDir: state, RecordsDir: records})
	hostDisk := mountnstest.LoopDevice(t, outside, "ext4", 16)
	outsideImg, err := filepath.Glob(filepath.Join(outside, "img-*.raw"))
	if err != nil || len(outsideImg) != 1 {
		t.Fatalf("image of %s: %v %v", hostDisk, outsideImg, err)
	}
	images := filepath.Join(state, "images")
	tests := []struct {
		name  string
		setup func(t *testing.T) string // returns the image to attach
	}{
		{"the image root is a symlink the plugin planted", func(t *testing.T) string {
			if err := os.Symlink(outside, images); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.Remove(images) })
			return filepath.Join(images, filepath.Base(outsideImg[0]))
		}},
		{"a block device node under the image root", func(t *testing.T) string {
			mkdirs(t, images)
			n := filepath.Join(images, "disk.img")
			mknodBlock(t, n, devOf(t, hostDisk))
			return n
		}},
		{"an image that is a symlink to a file outside the image root", func(t *testing.T) string {
			mkdirs(t, images)
			link := filepath.Join(images, "evil.img")
			if err := os.Symlink(outsideImg[0], link); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.Remove(link) })
			return link
		}},
		{"an image outside every image root", func(*testing.T) string { return outsideImg[0] }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			img := tt.setup(t)
			l, err := e.AttachLoop(context.Background(), mounter.LoopRequest{Image: img})
			if err == nil {
				_ = e.DetachLoop(context.Background(), l.Identity)
			}
			if !errors.Is(err, errdefs.ErrPermissionDenied) {
				t.Fatalf("AttachLoop(%s) = %+v, %v; want PermissionDenied", img, l, err)
			}
		})
	}
	// The records survive a restart of the mounter, and only what they
	// name is taken back: a device attached by someone else meanwhile is
	// not made the mounter's.
	vol := volumeDevice(t, e, state, "ext4", 16)
	again := node(t, mounter.Options{StateDir: state, RecordsDir: records})
	in := plan.Consumer{PID: mountnstest.Namespace(t, "private"), MountPoint: filepath.Join(dir, "mp")}
	if err := again.Mount(context.Background(), []plan.Mount{{Type: "ext4", Source: vol, Options: opts()}}, in); err != nil {
		t.Fatalf("a restarted mounter refuses a device it attached before: %v", err)
	}
	undo(t, again, in)
	if err := again.Mount(context.Background(), []plan.Mount{{Type: "ext4", Source: hostDisk, Options: opts()}}, in); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a restarted mounter: the host's disk = %v, want PermissionDenied", err)
	}
}

// TestReview5cCheckThenUse (review finding 5c): a plan used to be checked
// on paths and performed on paths. A bind source is resolved and checked
// (resolve), then open_tree(AT_FDCWD, path) looks the path up again and
// follows symlinks; a filesystem's device is opened and checked
// (openDevices), then fsconfig(source=path) looks the node up again. The
// window between them is made deterministic: the host-namespace check that
// Mount runs in between stats a file on a FUSE mount whose daemon is
// stopped, and the test swaps the path while Mount waits there. Secure:
// what is mounted is what was checked (or the call fails).
func TestReview5cCheckThenUse(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	state, outside, images := filepath.Join(dir, "state"), filepath.Join(dir, "outside"), filepath.Join(dir, "state", "images")
	victim := filepath.Join(outside, "victim")
	mkdirs(t, filepath.Join(state, "src"), victim, images)
	writeFile(t, filepath.Join(victim, "marker"), "host secret\n")
	e := node(t, mounter.Options{StateDir: state})
	volume := volumeDevice(t, e, state, "ext4", 16)
	hostDisk := mountnstest.LoopDevice(t, outside, "ext4", 16)
	devs := devTestDir(t)
	node := filepath.Join(devs, "vol")
	mknodBlock(t, node, devOf(t, volume))

	// A squashfs with one file per row that nothing has looked up yet.
	content := filepath.Join(dir, "content")
	mkdirs(t, content)
	for _, f := range []string{"ns-bind", "ns-ext4"} {
		writeFile(t, filepath.Join(content, f), "")
	}
	img := filepath.Join(dir, "stall.sqfs")
	mountnstest.Squashfs(t, content, img)
	stall := filepath.Join(dir, "stall")
	mkdirs(t, stall)
	daemon := startSquashfuse(t, img, stall)
	t.Cleanup(func() { _ = daemon.Process.Signal(syscall.SIGCONT) })

	tests := []struct {
		name   string
		hostNS string // the file whose lookup stalls Mount
		mount  plan.Mount
		swap   func(t *testing.T)
		// escaped reports whether the consumer got what was swapped in.
		escaped func(t *testing.T, mp string) bool
	}{
		{"bind source swapped for a symlink out of the root", "ns-bind",
			plan.Mount{Type: "bind", Source: filepath.Join(state, "src"), Options: opts()},
			func(t *testing.T) {
				if err := os.Rename(filepath.Join(state, "src"), filepath.Join(state, "src.checked")); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(victim, filepath.Join(state, "src")); err != nil {
					t.Fatal(err)
				}
			},
			func(t *testing.T, mp string) bool {
				_, err := os.Stat(inNS(pid, filepath.Join(mp, "marker")))
				return err == nil
			}},
		{"device node swapped for the host's disk after its check", "ns-ext4",
			plan.Mount{Type: "ext4", Source: node, Options: opts()},
			func(t *testing.T) {
				if err := os.Remove(node); err != nil {
					t.Fatal(err)
				}
				mknodBlock(t, node, devOf(t, hostDisk))
			},
			func(t *testing.T, mp string) bool { return mountedDev(t, pid, dir, mp) == devOf(t, hostDisk) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp-"+tt.hostNS)}
			restore := mounter.SetHostNS(filepath.Join(stall, tt.hostNS))
			defer restore()
			if err := daemon.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- e.Mount(context.Background(), []plan.Mount{tt.mount}, c) }()
			if returned, err := waitFuseRequest(t, done); returned {
				// A mounter that no longer looks at hostNS between its check
				// and its use: this stall cannot open the window any more.
				_ = daemon.Process.Signal(syscall.SIGCONT)
				if err == nil {
					undo(t, e, c)
				}
				t.Skipf("Mount returned (%v) without stalling on the FUSE lookup of hostNS: the window this test opens is not there", err)
			}
			tt.swap(t)
			if err := daemon.Process.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			err := <-done
			if err == nil {
				defer undo(t, e, c)
			}
			if tt.escaped(t, c.MountPoint) {
				dev := mountedDev(t, pid, dir, c.MountPoint)
				t.Errorf("Mount of %s = %v, and the consumer got what was swapped in after the check, not what was checked: "+
					"device %d:%d mounted at %s (the volume is %s, the host's disk %s)", tt.mount, err,
					unix.Major(dev), unix.Minor(dev), c.MountPoint, volume, hostDisk)
			}
		})
	}
}

// waitFuseRequest waits until a thread of this process waits for a FUSE
// answer (the stopped daemon's). If Mount returns first, it reports that
// and Mount's error.
func waitFuseRequest(t *testing.T, done <-chan error) (returned bool, err error) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		select {
		case err := <-done:
			return true, err
		default:
		}
		tasks, _ := filepath.Glob("/proc/self/task/*/wchan")
		for _, w := range tasks {
			if b, _ := os.ReadFile(w); string(b) == "request_wait_answer" {
				return false, nil
			}
		}
	}
	t.Fatal("Mount neither returned nor stalled on the FUSE lookup within 10s")
	return false, nil
}

// TestReview6aUnmountBySuffix (review finding 6a): once a plan's bind
// source is gone, Unmount takes whatever bind sits on the target for the
// plan's when the bind's root is a suffix of the source path, and any FUSE
// mount's root ("/") too. It then removes a mount that is not the plan's.
// Secure: the consumer's own mount stays.
func TestReview6aUnmountBySuffix(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "nsenter", "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	state := filepath.Join(dir, "state")
	own, mp, fmp := filepath.Join(dir, "own"), filepath.Join(dir, "mp"), filepath.Join(dir, "fmp")
	mkdirs(t, state, own, mp, fmp)
	// The consumer's own mount at mp: a bind of /data of a tmpfs of its
	// own, made inside its namespace (its mount table shows root /data).
	script := "mount -t tmpfs consumer-own " + own + " && mkdir " + own + "/data && echo mine > " + own + "/data/marker && mount --bind " + own + "/data " + mp
	if out, err := exec.Command("nsenter", "-t", strconv.Itoa(pid), "-m", "sh", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("consumer's own mount: %v: %s", err, out)
	}
	// Another volume's FUSE bind at fmp (a live squashfuse daemon).
	content := filepath.Join(dir, "content")
	mkdirs(t, content)
	writeFile(t, filepath.Join(content, "marker"), "other volume\n")
	img := filepath.Join(dir, "other.sqfs")
	mountnstest.Squashfs(t, content, img)
	other := filepath.Join(state, "fuse", "other", "mnt")
	mkdirs(t, other)
	startSquashfuse(t, img, other)
	e := executor(t, state)
	if err := mounter.RecordMount(e, "fuse", other); err != nil {
		t.Fatal(err)
	}
	if err := e.Mount(context.Background(), []plan.Mount{{Type: "bind", Source: other, Options: opts()}}, plan.Consumer{PID: pid, MountPoint: fmp}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { undo(t, e, plan.Consumer{PID: pid, MountPoint: fmp}) })

	for _, tt := range []struct{ name, mountPoint, source string }{
		// Neither source exists any more: a volume unstaged before its
		// consumer's unmount, or a request that names one on purpose.
		{"a bind whose root is a suffix of the gone source", mp, filepath.Join(state, "volumes", "v1", "data")},
		{"another volume's live FUSE bind", fmp, filepath.Join(state, "fuse", "gone", "mnt")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := mountedDev(t, pid, dir, tt.mountPoint)
			if before == 0 {
				t.Fatalf("nothing mounted at %s", tt.mountPoint)
			}
			err := e.Unmount(context.Background(), []plan.Mount{{Type: "bind", Source: tt.source, Options: opts()}}, plan.Consumer{PID: pid, MountPoint: tt.mountPoint})
			if got := mountedDev(t, pid, dir, tt.mountPoint); got != before {
				t.Errorf("Unmount of a bind of %s (gone) = %v and removed the mount at %s that is not the plan's", tt.source, err, tt.mountPoint)
			}
		})
	}
}
