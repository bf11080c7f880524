//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// inNS is path p as seen from inside pid's namespace, reachable from here.
func inNS(pid int, p string) string { return filepath.Join("/proc", strconv.Itoa(pid), "root", p) }

func countMounts(t *testing.T, pid int, dir string) int {
	t.Helper()
	return len(mountnstest.MountsUnder(t, pid, dir))
}

// TestMountRejects needs no privileges: every case fails before a syscall
// that would need them.
func TestMountRejects(t *testing.T) {
	root := t.TempDir()
	if err := os.Symlink("/etc", filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(root, "mp")
	tests := []struct {
		name   string
		mounts []plan.Mount
		c      plan.Consumer
		want   error
	}{
		{"target with ..", []plan.Mount{tmpfs("t", "../x")}, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"relative mount point", []plan.Mount{tmpfs("t", "")}, plan.Consumer{MountPoint: "mp"}, errdefs.ErrInvalidArgument},
		{"root as mount point", []plan.Mount{tmpfs("t", "")}, plan.Consumer{MountPoint: "/"}, errdefs.ErrInvalidArgument},
		{"negative pid", []plan.Mount{tmpfs("t", "")}, plan.Consumer{PID: -1, MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"no nosuid,nodev", []plan.Mount{{Type: "tmpfs", Source: "t"}}, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"type not allowed", []plan.Mount{{Type: "nfs", Source: "/dev/x", Options: safe}}, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"bind outside roots", []plan.Mount{{Type: "bind", Source: "/etc", Options: safe}}, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"bind through a symlink out of the root", []plan.Mount{{Type: "bind", Source: filepath.Join(root, "escape"), Options: safe}},
			plan.Consumer{MountPoint: mp}, errdefs.ErrPermissionDenied},
		{"overlay: no default type", []plan.Mount{{Type: "overlay", Source: "o",
			Options: opts("lowerdir=" + filepath.Join(root, "lower"))}}, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
		{"missing bind source", []plan.Mount{{Type: "bind", Source: filepath.Join(root, "none"), Options: safe}},
			plan.Consumer{MountPoint: mp}, errdefs.ErrNotFound},
		{"no such pid", []plan.Mount{tmpfs("t", "")}, plan.Consumer{PID: 1<<22 + 1, MountPoint: mp}, errdefs.ErrNotFound},
		{"namespace replaced", []plan.Mount{tmpfs("t", "")}, plan.Consumer{PID: os.Getpid(), Namespace: plan.Namespace{Inode: 1}, MountPoint: mp}, errdefs.ErrFailedPrecondition},
		{"empty plan", nil, plan.Consumer{MountPoint: mp}, errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := executor(t, root).Mount(context.Background(), tt.mounts, tt.c)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Mount = %v, want %v", err, tt.want)
			}
			if _, err := os.Lstat(mp); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("a refused plan created the mount point: %v", err)
			}
		})
	}
}

// TestUnmountOfGoneNamespace: the kernel dropped the mounts with the
// namespace, so there is nothing to do and nothing may be done elsewhere.
func TestUnmountOfGoneNamespace(t *testing.T) {
	for _, c := range []plan.Consumer{
		{PID: 1<<22 + 1, MountPoint: "/mnt/x"},
		{PID: os.Getpid(), Namespace: plan.Namespace{Inode: 1}, MountPoint: "/mnt/x"},
	} {
		if err := executor(t).Unmount(context.Background(), []plan.Mount{tmpfs("t", "")}, c); err != nil {
			t.Errorf("Unmount(%+v) = %v, want nil", c, err)
		}
		if err := executor(t).UnmountAll(context.Background(), c); err != nil {
			t.Errorf("UnmountAll(%+v) = %v, want nil", c, err)
		}
	}
}

func TestMountRollsBack(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	e := executor(t, dir)
	blank := volumeDevice(t, e, dir, "", 1)
	pid := mountnstest.Namespace(t, "private")
	tests := []struct {
		name   string
		mounts []plan.Mount
		want   error
	}{
		// The first is attached, then "sub" cannot be created on it.
		{"second fails to attach", []plan.Mount{tmpfs("first", "", "ro"), tmpfs("second", "sub")}, errdefs.ErrFailedPrecondition},
		// Nothing is attached: every mount is built before the first attach.
		{"second fails to build", []plan.Mount{tmpfs("first", ""), {Type: "ext4", Source: blank, Target: "sub", Options: safe}}, errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mp := filepath.Join(dir, "new", "mp")
			err := e.Mount(context.Background(), tt.mounts, plan.Consumer{PID: pid, MountPoint: mp})
			if !errors.Is(err, tt.want) {
				t.Fatalf("Mount = %v, want %v", err, tt.want)
			}
			if n := countMounts(t, pid, dir); n != 0 {
				t.Fatalf("%d mounts left in the namespace after a failed Mount (%v): %+v", n, err, mountnstest.MountsUnder(t, pid, dir)[0])
			}
			if _, err := os.Lstat(inNS(pid, filepath.Join(dir, "new"))); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("directories created by a failed Mount were left: %v", err)
			}
		})
	}
}

func TestMountUnmountIdempotent(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	e := node(t, mounter.Options{StateDir: dir, RemoveMountPoint: true})
	dev := volumeDevice(t, e, dir, "ext4", 16)
	src := filepath.Join(dir, "src")
	if err := os.Mkdir(src, 0o750); err != nil {
		t.Fatal(err)
	}
	pid := mountnstest.Namespace(t, "private")
	mounts := []plan.Mount{
		{Type: "ext4", Source: dev, Options: opts("noatime")},
		{Type: "bind", Source: src, Target: "data", Options: opts("ro")},
		tmpfs("scratch", "data/x"), // on the read-only bind: its mount point must already exist
	}
	if err := os.Mkdir(filepath.Join(src, "x"), 0o750); err != nil {
		t.Fatal(err)
	}
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp"), Namespace: plan.Namespace{Inode: mountnstest.NamespaceInode(t, pid)}}
	for i := range 2 {
		if err := e.Mount(context.Background(), mounts, c); err != nil {
			t.Fatalf("Mount #%d: %v", i+1, err)
		}
		if n := countMounts(t, pid, dir); n != 3 {
			t.Fatalf("after Mount #%d: %d mounts, want 3", i+1, n)
		}
	}
	if n := countMounts(t, 0, dir); n != 0 {
		t.Fatalf("%d mounts leaked into the host namespace", n)
	}
	for i := range 2 {
		if err := e.Unmount(context.Background(), mounts, c); err != nil {
			t.Fatalf("Unmount #%d: %v", i+1, err)
		}
		if n := countMounts(t, pid, dir); n != 0 {
			t.Fatalf("after Unmount #%d: %d mounts, want 0", i+1, n)
		}
	}
	if _, err := os.Lstat(inNS(pid, c.MountPoint)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("mount point not removed: %v", err)
	}
}

// TestUnmountLeavesWhatLiesUnderneath: a repeated Unmount must not remove
// the consumer's own mount that the volume was stacked on.
func TestUnmountLeavesWhatLiesUnderneath(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	// RemoveMountPoint: and it must not try while "theirs" is mounted.
	e := node(t, mounter.Options{StateDir: dir, RemoveMountPoint: true})
	theirs := []plan.Mount{tmpfs("theirs", "")}
	ours := []plan.Mount{tmpfs("ours", "")}
	if err := e.Mount(context.Background(), theirs, c); err != nil {
		t.Fatal(err)
	}
	if err := e.Mount(context.Background(), ours, c); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		err := e.Unmount(context.Background(), ours, c)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Fatalf("Unmount with the consumer's mount left = %v, want FailedPrecondition (mount point busy)", err)
		}
	}
	left := mountnstest.MountsUnder(t, pid, dir)
	if len(left) != 1 || left[0].Source != "theirs" {
		t.Fatalf("left: %v, want only the consumer's tmpfs", left)
	}
	if err := e.UnmountAll(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, pid, dir); n != 0 {
		t.Fatalf("UnmountAll left %d mounts", n)
	}
}

// TestOverlayPlanRefused: a plan may not name host paths in options (the
// kernel would resolve them after every check); chains are bound from the
// overlay the mounter built (TestBuildChain).
func TestOverlayPlanRefused(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	for _, d := range []string{"lower", "upper", "work"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	pid := mountnstest.Namespace(t, "private")
	mounts := []plan.Mount{{Type: "overlay", Source: "mp-overlay", Options: opts(
		"lowerdir="+filepath.Join(dir, "lower"), "upperdir="+filepath.Join(dir, "upper"), "workdir="+filepath.Join(dir, "work"))}}
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	// Even where the admin's types allow overlay.
	e := node(t, mounter.Options{StateDir: dir, Config: &config.Config{MountPolicy: config.MountPolicy{Types: []string{"overlay"}}}})
	if err := e.Mount(context.Background(), mounts, c); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("overlay plan = %v, want PermissionDenied", err)
	}
	if n := countMounts(t, pid, dir); n != 0 {
		t.Fatalf("%d mounts after a refused plan", n)
	}
}

// TestBlockBindOntoNewFile: raw block access binds the device node onto a
// file the mounter creates.
func TestBlockBindOntoNewFile(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	// nodev would make the device node unusable.
	e := node(t, mounter.Options{StateDir: dir, RemoveMountPoint: true, Config: &config.Config{MountPolicy: config.MountPolicy{AllowSuidDev: true}}})
	dev := volumeDevice(t, e, dir, "", 1)
	pid := mountnstest.Namespace(t, "private")
	mounts := []plan.Mount{{Type: "bind", Source: dev, Options: []string{"nosuid"}}}
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "dev", "block")}
	if err := e.Mount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	var want, got unix.Stat_t
	if err := unix.Stat(dev, &want); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(inNS(pid, c.MountPoint), &got); err != nil {
		t.Fatal(err)
	}
	if got.Mode&unix.S_IFMT != unix.S_IFBLK || got.Rdev != want.Rdev {
		t.Fatalf("mount point is mode %o rdev %d, want block device %d", got.Mode, got.Rdev, want.Rdev)
	}
	if err := e.Unmount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(inNS(pid, c.MountPoint)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("mount point file not removed: %v", err)
	}
}

// sharedTmpfs mounts a shared tmpfs at p (made) in the test's namespace,
// unmounted at the test's end, and returns p.
func sharedTmpfs(t *testing.T, p string) string {
	t.Helper()
	if err := os.Mkdir(p, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("mp-shared", p, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
	if err := unix.Mount("", p, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestSharedParent: under a mount that is a peer of one in the host, the
// volume would appear in the host too and outlive the consumer.
func TestSharedParent(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	shared := sharedTmpfs(t, filepath.Join(dir, "shared"))
	pid := mountnstest.Namespace(t, "unchanged")
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(shared, "mp")}
	mounts := []plan.Mount{tmpfs("vol", "")}

	// The kernel tells the parent is shared (statmount), and so does
	// the mount table, as on a kernel before 6.8.
	for _, how := range []string{"statmount", "mount table"} {
		restore := func() {}
		if how == "mount table" {
			restore = mounter.ReadMountTablesOnly()
		}
		err := executor(t, dir).Mount(context.Background(), mounts, c)
		restore()
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "peer group") {
			t.Fatalf("%s: Mount under a shared parent = %v, want FailedPrecondition", how, err)
		}
		if n := countMounts(t, 0, shared) + countMounts(t, pid, shared); n != 2 {
			t.Fatalf("%s: refused Mount left mounts: %d under %s, want only the shared tmpfs in each namespace", how, n, shared)
		}
	}

	// Allowed, it propagates: what the check prevents by default.
	e := node(t, mounter.Options{StateDir: dir, AllowPropagation: true})
	if err := e.Mount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, 0, c.MountPoint); n != 1 {
		t.Fatalf("with propagation allowed the host sees %d mounts, want 1", n)
	}
	if err := e.Unmount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, 0, c.MountPoint) + countMounts(t, pid, c.MountPoint); n != 0 {
		t.Fatalf("%d mounts left after Unmount", n)
	}
}

// TestOwnNamespace is kubelet's flow: PID 0, the mounter's own namespace.
func TestOwnNamespace(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	e := node(t, mounter.Options{StateDir: dir, RemoveMountPoint: true})
	c := plan.Consumer{MountPoint: filepath.Join(dir, "target")}
	mounts := []plan.Mount{tmpfs("kubelet", "")}
	if err := e.Mount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := countMounts(t, 0, dir); n != 1 {
		t.Fatalf("%d mounts, want 1", n)
	}
	if err := e.Unmount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(c.MountPoint); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("target not removed: %v", err)
	}
}

// TestNoSecretInErrors plants a canary in an option value.
func TestNoSecretInErrors(t *testing.T) {
	mountnstest.RequireRoot(t)
	const canary = "canary-9f8e7d6c5b4a"
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	err := executor(t, dir).Mount(context.Background(), []plan.Mount{tmpfs("t", "", "nosuchkey="+canary)},
		plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")})
	if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || strings.Contains(err.Error(), canary) {
		t.Fatalf("Mount = %v, want InvalidArgument without the option value", err)
	}
}
