package guard_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/testutil"
)

// bindGuard binds what Path leads to at target, as the plugin's NRI-mode
// publish does through the mounter.
func bindGuard(t *testing.T, stateDir, target string) error {
	t.Helper()
	src, err := guard.Source(stateDir)
	if err != nil {
		return err
	}
	fd, err := mountns.Build(guard.Bind(guard.At(src, target)))
	if err != nil {
		return err
	}
	defer fd.Close()
	return mountns.Attach(fd, target)
}

// recorder is the mounter's side of guard.Recorder: the guards it was told
// of, by path, with their filesystems' device numbers.
type recorder map[string]uint64

func (r recorder) RecordGuard(p string, root *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(root.Fd()), &st); err != nil {
		return err
	}
	r[p] = uint64(st.Dev) //nolint:unconvert // Dev is uint32 on some architectures
	return nil
}

func (r recorder) ForgetGuard(p string) error { delete(r, p); return nil }

func TestGuardLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	dir := t.TempDir()
	state, kubelet := filepath.Join(dir, "state"), filepath.Join(dir, "kubelet")
	target := filepath.Join(kubelet, "pods", "uid", "volumes", "kubernetes.io~csi", "pv", "mount")
	if err := os.MkdirAll(target, 0o750); err != nil {
		t.Fatal(err)
	}
	rec := recorder{}
	g, err := guard.Start(state, rec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Stop() })
	// The mounter is told of the guard's mount point, the resolved one
	// (it follows no symlink in a bind's source), and its root.
	src, err := guard.Source(state)
	if err != nil || src != g.Source() || filepath.Dir(src) != filepath.Join(state, "nri") {
		t.Fatalf("Source = %q, %v; want %s below %s/nri", src, err, g.Source(), state)
	}
	if st, err := os.Stat(src); err != nil || rec[src] == 0 || rec[src] != devOf(st) || len(rec) != 1 {
		t.Errorf("recorded %v; want %s with its device (%v)", rec, src, err)
	}
	if err := bindGuard(t, state, target); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mountns.Unmount(target, true) })

	// Alive: stat works (the runtime's and kubelet's checks pass), nothing
	// else does, and a bind of it (what a runtime does without the hook)
	// gives nothing usable.
	if fi, err := os.Stat(target); err != nil || !fi.IsDir() {
		t.Fatalf("stat of the armed target: %v, %v", fi, err)
	}
	if _, err := os.ReadDir(target); !errors.Is(err, unix.EACCES) {
		t.Errorf("listing the armed target: %v, want EACCES", err)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), nil, 0o644); err == nil {
		t.Error("a file could be created in the armed target")
	}
	// What kubelet does to prepare a subPath: stat it (making it when it is
	// missing, which the guard refuses), then bind it. Every name below a
	// target is an empty directory, and the guard tells which target and
	// subPath a bind of one is.
	if err := os.Mkdir(filepath.Join(target, "new"), 0o755); err == nil {
		t.Error("a subdirectory could be made in the armed target")
	}
	subPath := filepath.Join(target, "sub", "dir")
	if fi, err := os.Stat(subPath); err != nil || !fi.IsDir() {
		t.Fatalf("stat of a subPath in the armed target: %v, %v; want a directory", fi, err)
	}
	if _, err := os.ReadDir(subPath); !errors.Is(err, unix.EACCES) {
		t.Errorf("listing a subPath of the armed target: %v, want EACCES", err)
	}
	bound := filepath.Join(dir, "kubelet", "pods", "uid", "volume-subpaths", "v", "c", "0")
	if err := os.MkdirAll(bound, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(subPath, bound, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mountns.Unmount(bound, true) })
	for _, c := range []struct{ path, name, sub string }{{target, "pv", ""}, {bound, "pv", "sub/dir"}, {subPath, "pv", "sub/dir"}} {
		if name, sub, ours, err := g.Locate(context.Background(), c.path); name != c.name || sub != c.sub || !ours || err != nil {
			t.Errorf("Locate(%s) = %q, %q, %v, %v; want %q, %q, true", c.path, name, sub, ours, err, c.name, c.sub)
		}
	}
	if _, _, ours, err := g.Locate(context.Background(), dir); ours || err != nil {
		t.Errorf("Locate(a plain directory) = %v, %v; want not ours", ours, err)
	}

	// Stopped: even stat fails, as a runtime's would; GuardPath is gone, so
	// no new publish can bind it.
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(target); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("stat of a target whose guard stopped: %v, want ENOTCONN", err)
	}
	// runc stats a bind's source in the container's new namespace (a copy
	// of this one) before it binds it.
	out, err := exec.Command("unshare", "-m", "--propagation", "private", "stat", target).CombinedOutput()
	if err == nil {
		t.Errorf("stat of a dead guard's target in a new mount namespace succeeded: %s", out)
	}
	if _, err := os.Lstat(guard.Path(state)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("GuardPath after Stop: %v, want it gone", err)
	}
	if len(rec) != 0 {
		t.Errorf("still recorded after Stop: %v", rec)
	}
	if err := bindGuard(t, state, filepath.Join(dir, "kubelet")); err == nil {
		t.Error("a publish could bind the guard while none runs")
	}

	// A new guard re-arms the target.
	g2, err := guard.Start(state, rec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g2.Stop() })
	if _, _, _, err := g2.Locate(context.Background(), target); err == nil {
		t.Error("Locate of a target bound to a dead guard: no error")
	}
	n, err := g2.Rearm(kubelet)
	if err != nil || n != 2 {
		t.Fatalf("Rearm = %d, %v; want 2 (the target and its subPath's bind)", n, err)
	}
	// Each re-armed where it was: the target's directory, the subPath.
	for _, c := range []struct{ path, sub string }{{target, ""}, {bound, "sub/dir"}} {
		if name, sub, ours, err := g2.Locate(context.Background(), c.path); name != "pv" || sub != c.sub || !ours || err != nil {
			t.Errorf("Locate(%s) after Rearm = %q, %q, %v, %v; want pv, %q", c.path, name, sub, ours, err, c.sub)
		}
	}
	if n, err := g2.Rearm(kubelet); err != nil || n != 0 {
		t.Errorf("second Rearm = %d, %v; want 0", n, err)
	}
}

func devOf(fi os.FileInfo) uint64 {
	return uint64(fi.Sys().(*syscall.Stat_t).Dev) //nolint:unconvert // Dev is uint32 on some architectures
}

// TestGuardHostile: the plugin owns the state dir and may plant anything
// in it. A <state>/nri that is a symlink out of it gets no guard (nothing
// is made or mounted where it leads); an old guard's entry that is a
// symlink to a mount elsewhere is removed, never followed, and that mount
// stays.
func TestGuardHostile(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	dir := t.TempDir()
	state, outside := filepath.Join(dir, "state"), filepath.Join(dir, "outside")
	for _, d := range []string{state, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(outside, filepath.Join(state, "nri")); err != nil {
		t.Fatal(err)
	}
	if g, err := guard.Start(state, nil); !errors.Is(err, errdefs.ErrPermissionDenied) {
		if err == nil {
			_ = g.Stop()
		}
		t.Errorf("Start with <state>/nri a symlink out of the state dir = %v, want PermissionDenied", err)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Errorf("Start made %v where the symlink leads", ents)
	}
	if err := os.Remove(filepath.Join(state, "nri")); err != nil {
		t.Fatal(err)
	}

	// An earlier guard's name, planted as a symlink to a mount outside.
	if err := unix.Mount("victim", outside, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mountns.Unmount(outside, true) })
	if err := os.Mkdir(filepath.Join(state, "nri"), 0o700); err != nil {
		t.Fatal(err)
	}
	planted := filepath.Join(state, "nri", "g-planted")
	if err := os.Symlink(outside, planted); err != nil {
		t.Fatal(err)
	}
	g, err := guard.Start(state, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Stop() })
	if mounted, err := mountns.IsMountPoint(outside); err != nil || !mounted {
		t.Errorf("the mount a planted guard entry led to: mounted %v, %v; want it to stay", mounted, err)
	}
	if _, err := os.Lstat(planted); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the planted entry: %v, want it removed", err)
	}
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
}

// TestRearmUnderSharedParent: kubelet's directory is usually a shared
// mount. A publish made under a guard that died (its plan names that
// guard's gone mount point) is undone by the mounter's unmount all the
// same, whether the new guard went beneath the dead one (Rearm, where the
// kernel allows it) or on top of it (where it refuses: played here by
// attaching the new guard's bind on top by hand), and nothing stays at the
// target.
func TestRearmUnderSharedParent(t *testing.T) {
	for _, rearm := range []string{"Rearm", "on top"} {
		t.Run(rearm, func(t *testing.T) { testRearmUnderSharedParent(t, rearm == "Rearm") })
	}
}

func testRearmUnderSharedParent(t *testing.T, rearm bool) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	dir := t.TempDir()
	state, kubelet, records := filepath.Join(dir, "state"), filepath.Join(dir, "kubelet"), filepath.Join(dir, "records")
	target := filepath.Join(kubelet, "pods", "uid", "volumes", "kubernetes.io~csi", "pv", "mount")
	if err := os.MkdirAll(target, 0o750); err != nil {
		t.Fatal(err)
	}
	// kubelet's directory: a shared mount of its own.
	if err := unix.Mount(kubelet, kubelet, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mountns.Unmount(kubelet, true) })
	if err := unix.Mount("", kubelet, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	n, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: state, KubeletDir: kubelet, RecordsDir: records})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	g1, err := guard.Start(state, n)
	if err != nil {
		t.Fatal(err)
	}
	src, err := guard.Source(state)
	if err != nil {
		t.Fatal(err)
	}
	publish := []plan.Mount{guard.Bind(guard.At(src, target))} // as the plugin publishes
	c := plan.Consumer{MountPoint: target}
	if err := n.Mount(context.Background(), publish, c); err != nil {
		t.Fatalf("the publish's bind of the guard: %v", err)
	}
	if err := g1.Stop(); err != nil {
		t.Fatal(err)
	}
	g2, err := guard.Start(state, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g2.Stop() })
	if rearm {
		if got, err := g2.Rearm(kubelet); err != nil || got != 1 {
			t.Fatalf("Rearm = %d, %v; want 1", got, err)
		}
	} else if err := bindGuard(t, state, target); err != nil {
		t.Fatal(err)
	}
	if _, _, ours, err := g2.Locate(context.Background(), target); !ours || err != nil {
		t.Fatalf("Locate(target) after the new guard came = %v, %v", ours, err)
	}
	if err := n.Unmount(context.Background(), publish, c); err != nil {
		t.Fatalf("the unpublish: %v", err)
	}
	if mounted, err := mountns.IsMountPoint(target); err != nil || mounted {
		t.Errorf("after the unpublish the target is a mount point (%v, %v): a guard stayed", mounted, err)
	}
}
