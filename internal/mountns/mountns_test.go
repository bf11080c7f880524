//go:build linux

package mountns_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestSupported(t *testing.T) {
	mountnstest.RequireRoot(t)
	if err := mountns.Supported(); err != nil {
		t.Fatalf("Supported: %v", err)
	}
}

// attachInto builds m here and attaches it at target inside pid's namespace.
func attachInto(t *testing.T, pid int, m plan.Mount, target string) {
	t.Helper()
	fd, err := mountns.Build(m)
	if err != nil {
		t.Fatalf("Build %s: %v", m, err)
	}
	defer fd.Close()
	ns, err := mountns.OpenPID(pid, plan.Namespace{})
	if err != nil {
		t.Fatalf("OpenPID: %v", err)
	}
	defer ns.Close()
	if ns.IsSelf() {
		t.Fatal("unshare'd process shares the test's namespace")
	}
	if err := ns.Do(func() error { return mountns.Attach(fd, target) }); err != nil {
		t.Fatalf("Attach: %v", err)
	}
}

// requireOnlyInNamespace proves target is mounted (with fstype) in pid's
// namespace and not in the test's.
func requireOnlyInNamespace(t *testing.T, pid int, target, fstype string) {
	t.Helper()
	in := mountnstest.MountsUnder(t, pid, target)
	if len(in) != 1 || in[0].Mountpoint != target || in[0].FSType != fstype {
		t.Fatalf("namespace mounts under %s = %v, want one %s", target, in, fstype)
	}
	if host := mountnstest.MountsUnder(t, 0, target); len(host) != 0 {
		t.Fatalf("mount leaked into the host namespace: %+v", host[0])
	}
}

func TestAttachTmpfsIntoNamespace(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	attachInto(t, pid, plan.Mount{Type: "tmpfs", Source: "mp-test", Options: []string{"nosuid", "nodev", "size=1m"}}, dir)
	requireOnlyInNamespace(t, pid, dir, "tmpfs")
	info := mountnstest.MountsUnder(t, pid, dir)[0]
	if info.Source != "mp-test" || !strings.Contains(info.Options, "nosuid") || !strings.Contains(info.Options, "nodev") {
		t.Fatalf("mount = %+v, want source mp-test with nosuid,nodev", info)
	}
}

func TestAttachExt4FromLoopIntoNamespace(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	dev := mountnstest.LoopDevice(t, dir, "ext4", 16)
	pid := mountnstest.Namespace(t, "private")
	target := filepath.Join(dir, "mnt")
	if err := os.Mkdir(target, 0o750); err != nil {
		t.Fatal(err)
	}
	attachInto(t, pid, plan.Mount{Type: "ext4", Source: dev, Options: []string{"nosuid", "nodev", "noatime"}}, target)
	requireOnlyInNamespace(t, pid, target, "ext4")

	// Data written through the namespace lands on the volume, not in the
	// host's directory underneath.
	inNS := filepath.Join("/proc", strconv.Itoa(pid), "root", target, "hello")
	if err := os.WriteFile(inNS, []byte("hi"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(target, "hello")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("file written in the namespace is visible in the host directory: %v", err)
	}
}

func TestBindDeviceNodeOntoFileReadOnly(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	dev := mountnstest.LoopDevice(t, dir, "", 1)
	pid := mountnstest.Namespace(t, "private")
	target := filepath.Join(dir, "block")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	attachInto(t, pid, plan.Mount{Type: plan.TypeBind, Source: dev, Options: []string{"ro", "nosuid"}}, target)
	requireOnlyInNamespace(t, pid, target, "devtmpfs")

	var src, dst unix.Stat_t
	if err := unix.Stat(dev, &src); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Join("/proc", strconv.Itoa(pid), "root", target), &dst); err != nil {
		t.Fatal(err)
	}
	if dst.Mode&unix.S_IFMT != unix.S_IFBLK || dst.Rdev != src.Rdev {
		t.Fatalf("target in namespace: mode %o rdev %d, want block device %d", dst.Mode, dst.Rdev, src.Rdev)
	}
	info := mountnstest.MountsUnder(t, pid, target)[0]
	if !strings.HasPrefix(info.Options, "ro,") || strings.Contains(info.Optional, "shared:") {
		t.Fatalf("bind = %+v, want read-only and private", info)
	}
}

func TestOpenPID(t *testing.T) {
	self, err := mountns.Self()
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	tests := []struct {
		name string
		pid  int
		id   plan.Namespace
		want error
	}{
		{"own pid", os.Getpid(), plan.Namespace{}, nil},
		{"own pid, right inode", os.Getpid(), plan.Namespace{Inode: self.Inode()}, nil},
		{"own pid, right identity", os.Getpid(), self.Identity(), nil},
		{"no such pid", 1<<22 + 1, plan.Namespace{}, errdefs.ErrNotFound}, // above the largest pid_max
		{"zero pid", 0, plan.Namespace{}, errdefs.ErrInvalidArgument},
		{"namespace replaced", os.Getpid(), plan.Namespace{Inode: self.Inode() + 1}, errdefs.ErrFailedPrecondition},
		{"same inode, another namespace", os.Getpid(), plan.Namespace{Inode: self.Inode(), ID: self.Identity().ID + 1}, errdefs.ErrFailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns, err := mountns.OpenPID(tt.pid, tt.id)
			if !errors.Is(err, tt.want) {
				t.Fatalf("OpenPID(%d, %+v) = %v, want %v", tt.pid, tt.id, err, tt.want)
			}
			if err == nil {
				defer ns.Close()
				if !ns.IsSelf() || ns.Identity() != self.Identity() {
					t.Fatalf("own namespace: self=%v identity=%+v, want %+v", ns.IsSelf(), ns.Identity(), self.Identity())
				}
			}
		})
	}
}

func TestOpenPIDOfOtherNamespace(t *testing.T) {
	mountnstest.RequireRoot(t)
	pid := mountnstest.Namespace(t, "private")
	want := mountnstest.NamespaceInode(t, pid)
	ns, err := mountns.OpenPID(pid, plan.Namespace{Inode: want})
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if ns.IsSelf() || ns.Inode() != want {
		t.Fatalf("self=%v inode=%d, want other namespace %d", ns.IsSelf(), ns.Inode(), want)
	}
	if _, err := mountns.OpenPID(pid, plan.Namespace{Inode: want + 1}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("wrong inode: %v, want FailedPrecondition", err)
	}
}

// TestBuildErrors checks that a failed build names the syscall, the source
// and the option key, carries the kernel's own message, and never repeats an
// option value.
func TestBuildErrors(t *testing.T) {
	mountnstest.RequireRoot(t)
	const canary = "canary-s3cr3t-value"
	dir := mountnstest.Scratch(t)
	blank := mountnstest.LoopDevice(t, dir, "", 1)
	tests := []struct {
		name     string
		m        plan.Mount
		sentinel error
		want     []string
	}{
		{"unknown option", plan.Mount{Type: "tmpfs", Source: "x", Options: []string{"bogus=" + canary}},
			errdefs.ErrInvalidArgument, []string{"fsconfig", `"bogus"`, "Unknown parameter"}},
		{"no filesystem on device", plan.Mount{Type: "ext4", Source: blank, Options: []string{"ro"}},
			errdefs.ErrInvalidArgument, []string{"fsconfig", blank, "ext4"}},
		{"missing device", plan.Mount{Type: "ext4", Source: "/dev/mountplan-none"},
			errdefs.ErrNotFound, []string{"/dev/mountplan-none"}},
		{"unknown type", plan.Mount{Type: "nosuchfs", Source: "/dev/null"},
			errdefs.ErrInvalidArgument, []string{"fsopen", "nosuchfs"}},
		{"missing bind source", plan.Mount{Type: plan.TypeBind, Source: filepath.Join(dir, "none")},
			errdefs.ErrNotFound, []string{"open_tree"}},
		{"bind with data option", plan.Mount{Type: plan.TypeBind, Source: dir, Options: []string{"mode=" + canary}},
			errdefs.ErrInvalidArgument, []string{`"mode"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fd, err := mountns.Build(tt.m)
			if err == nil {
				fd.Close()
				t.Fatal("Build succeeded")
			}
			if !errors.Is(err, tt.sentinel) {
				t.Errorf("error %v does not wrap %v", err, tt.sentinel)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), canary) {
				t.Errorf("error %q repeats an option value", err)
			}
		})
	}
}

// TestDoLeavesMainThreadAlone: the runtime cannot end the main thread, so
// if Do ever entered a namespace on it, /proc/self (which names the main
// thread) would show the consumer's namespace for the rest of the process.
func TestDoLeavesMainThreadAlone(t *testing.T) {
	mountnstest.RequireRoot(t)
	pid := mountnstest.Namespace(t, "private")
	ns, err := mountns.OpenPID(pid, plan.Namespace{})
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	// Many at once, so that the scheduler has every chance to pick the
	// main thread for one of them.
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for range 10 {
				if err := ns.Do(func() error { return nil }); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	var self, main unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/mnt", &self); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat("/proc/self/ns/mnt", &main); err != nil {
		t.Fatal(err)
	}
	if main.Ino != self.Ino {
		t.Fatalf("main thread is in mount namespace %d, the process in %d", main.Ino, self.Ino)
	}
}

// TestReadOnlyDevice: a read-only image on a read-only loop device mounts
// only with a read-only superblock, which "ro" asks for.
func TestReadOnlyDevice(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "mkfs.erofs")
	dir := mountnstest.Scratch(t)
	content := filepath.Join(dir, "content")
	if err := os.Mkdir(content, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(content, "f"), []byte("erofs"), 0o600); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "img.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", img, content).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	dev := mountnstest.AttachLoop(t, img, true)
	pid := mountnstest.Namespace(t, "private")
	target := filepath.Join(dir, "mnt")
	if err := os.Mkdir(target, 0o750); err != nil {
		t.Fatal(err)
	}
	attachInto(t, pid, plan.Mount{Type: "erofs", Source: dev, Options: []string{"ro", "nosuid", "nodev"}}, target)
	requireOnlyInNamespace(t, pid, target, "erofs")
	if b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "root", target, "f")); err != nil || string(b) != "erofs" {
		t.Fatalf("read through the namespace: %q, %v", b, err)
	}
}

// SubTree: a detached mount of a directory of a detached mount. An
// existing directory is what it shows; a missing one is made with the
// mode of the root; a symlink on the way, or a file, is refused.
func TestSubTree(t *testing.T) {
	mountnstest.RequireRoot(t)
	mnt, err := mountns.Build(plan.Mount{Type: "tmpfs", Source: "mp-subtree", Options: []string{"nosuid", "nodev", "size=1m", "mode=0751"}})
	if err != nil {
		t.Fatal(err)
	}
	defer mnt.Close()
	root := "/proc/self/fd/" + strconv.Itoa(int(mnt.Fd()))
	for _, d := range []string{"app", "app/inner"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "app", "token"), []byte("t"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/", filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("app", filepath.Join(root, "inside")); err != nil {
		t.Fatal(err)
	}
	names := func(f *os.File) []string {
		t.Helper()
		entries, err := os.ReadDir("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range entries {
			got = append(got, e.Name())
		}
		return got
	}

	app, err := mountns.SubTree(mnt, "app")
	if err != nil {
		t.Fatal(err)
	}
	if got := names(app); strings.Join(got, ",") != "inner,token" {
		t.Errorf("SubTree(app) shows %v, want inner,token", got)
	}
	app.Close()

	made, err := mountns.SubTree(mnt, "new/deeper")
	if err != nil {
		t.Fatal(err)
	}
	made.Close()
	for _, d := range []string{"new", "new/deeper"} {
		fi, err := os.Stat(filepath.Join(root, d))
		if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o751 {
			t.Errorf("made %s: %v, %v; want a directory of mode 0751 (the root's)", d, fi, err)
		}
	}

	for _, c := range []struct{ sub, why string }{{"escape", "symlink"}, {"inside/inner", "symlink"}, {"app/token", "not a directory"}} {
		f, err := mountns.SubTree(mnt, c.sub)
		if err == nil {
			f.Close()
			t.Errorf("SubTree(%s) succeeded, want refused (%s)", c.sub, c.why)
			continue
		}
		if !strings.Contains(err.Error(), c.why) || (!errors.Is(err, errdefs.ErrPermissionDenied) && !errors.Is(err, errdefs.ErrFailedPrecondition)) {
			t.Errorf("SubTree(%s) = %v, want refused: %s", c.sub, err, c.why)
		}
	}
}
