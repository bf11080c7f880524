//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// targetsFixture is a kubelet dir with a file, a directory and a symlink
// to a directory outside it (which stands for the host's files) in it.
type targetsFixture struct {
	kubelet, outside string
	n                *mounter.Local
}

func newTargetsFixture(t *testing.T) *targetsFixture {
	t.Helper()
	base := mountnstest.Scratch(t)
	f := &targetsFixture{kubelet: filepath.Join(base, "kubelet"), outside: filepath.Join(base, "outside")}
	for _, d := range []string{f.kubelet, f.outside, filepath.Join(f.kubelet, "dir"), filepath.Join(f.outside, "empty")} {
		if err := os.Mkdir(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(f.kubelet, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.outside, "victim"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(f.outside, filepath.Join(f.kubelet, "link")); err != nil {
		t.Fatal(err)
	}
	f.n = node(t, mounter.Options{StateDir: filepath.Join(base, "state"), KubeletDir: f.kubelet})
	return f
}

// outsideUntouched fails unless the outside directory holds what the
// fixture put there and nothing else.
func (f *targetsFixture) outsideUntouched(t *testing.T) {
	t.Helper()
	got := listDir(t, f.outside)
	if len(got) != 2 || got[0] != "empty" || got[1] != "victim" {
		t.Fatalf("the directory outside the kubelet dir now holds %v, want [empty victim]", got)
	}
}

// TestMakeTarget checks what MakeTarget makes below the kubelet dir through
// one Root: missing parents and the target, reporting whether it made the
// target, and refusals, with nothing made outside, for a path outside the
// kubelet dir (PermissionDenied), a parent that is a file or a symlink and a
// target of the wrong kind (InvalidArgument).
func TestMakeTarget(t *testing.T) {
	f := newTargetsFixture(t)
	rows := []struct {
		name        string
		target      string // below the kubelet dir, or absolute
		block       bool
		wantCreated bool
		wantErr     error
		wantMode    os.FileMode // of the target afterwards, when no error
	}{
		{"missing parents and directory", "pods/u/volumes/v/mount", false, true, nil, os.ModeDir},
		{"the same again", "pods/u/volumes/v/mount", false, false, nil, os.ModeDir},
		{"block target: an empty file", "pods/u/volumes/b/dev", true, true, nil, 0},
		{"an existing directory", "dir", false, false, nil, os.ModeDir},
		{"a parent that is a file", "file/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"a parent that is a symlink", "link/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"a symlink in the parents", "link/a/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"the target a symlink", "link", false, false, errdefs.ErrInvalidArgument, 0},
		{"a file where a directory is wanted", "file", false, false, errdefs.ErrInvalidArgument, 0},
		{"a directory where a file is wanted", "dir", true, false, errdefs.ErrInvalidArgument, 0},
		{"outside the kubelet dir", "/outside/mount", false, false, errdefs.ErrPermissionDenied, 0},
		{"the kubelet dir itself", "/", false, false, errdefs.ErrPermissionDenied, 0},
		{"up and out by dot-dot", "../outside/mount", false, false, errdefs.ErrInvalidArgument, 0},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			p := f.kubelet + "/" + r.target
			switch {
			case r.target == "/":
				p = f.kubelet
			case filepath.IsAbs(r.target):
				p = filepath.Dir(f.kubelet) + r.target
			}
			created, err := f.n.MakeTarget(context.Background(), p, r.block)
			if r.wantErr != nil {
				if !errors.Is(err, r.wantErr) || created {
					t.Fatalf("MakeTarget(%s) = %t, %v; want %v", p, created, err, r.wantErr)
				}
				return
			}
			if err != nil || created != r.wantCreated {
				t.Fatalf("MakeTarget(%s) = %t, %v; want %t", p, created, err, r.wantCreated)
			}
			fi, err := os.Lstat(p)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Type() != r.wantMode {
				t.Fatalf("%s is %v, want type %v", p, fi.Mode().Type(), r.wantMode)
			}
		})
	}
	f.outsideUntouched(t)
}

// TestRemoveTarget removes what it is asked to only while it holds nothing,
// and never through or at a symlink: the empty directory a symlink in the
// kubelet dir leads to stays, and so does a mount point.
func TestRemoveTarget(t *testing.T) {
	mountnstest.RequireRoot(t)
	f := newTargetsFixture(t)
	k := f.kubelet
	for _, d := range []string{"empty", "full", "mnt"} {
		if err := os.Mkdir(filepath.Join(k, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(k, "full", "x"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(k, "written"), []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	mountTmpfs(t, "t", filepath.Join(k, "mnt"))
	rows := []struct {
		name     string
		target   string
		wantErr  error
		wantGone bool
	}{
		{"an empty directory", "empty", nil, true},
		{"an empty file", "file", nil, true},
		{"what is gone", "empty", nil, true},
		{"a directory with an entry", "full", nil, false},
		{"a file written to", "written", nil, false},
		{"a symlink to an empty directory outside", "link", nil, false},
		{"through a symlink to an empty directory outside", "link/empty", errdefs.ErrInvalidArgument, false},
		{"a mount point", "mnt", errdefs.ErrFailedPrecondition, false},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			p := filepath.Join(k, r.target)
			err := f.n.RemoveTarget(context.Background(), p)
			if (r.wantErr == nil) != (err == nil) || (r.wantErr != nil && !errors.Is(err, r.wantErr)) {
				t.Fatalf("RemoveTarget(%s) = %v, want %v", p, err, r.wantErr)
			}
			var st unix.Stat_t
			if gone := unix.Lstat(p, &st) != nil; gone != r.wantGone {
				t.Fatalf("after RemoveTarget(%s): gone %t, want %t", p, gone, r.wantGone)
			}
		})
	}
	if err := f.n.RemoveTarget(context.Background(), filepath.Join(f.outside, "empty")); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("RemoveTarget outside the kubelet dir = %v, want PermissionDenied", err)
	}
	f.outsideUntouched(t)
	if n := len(mountnstest.MountsUnder(t, 0, filepath.Join(k, "mnt"))); n != 1 {
		t.Fatalf("%d mounts at mnt after RemoveTarget, want its tmpfs", n)
	}
}

// TestTargetState reports a real tmpfs mount point, a device node, what is
// missing and refuses a path through a symlink, without following it.
func TestTargetState(t *testing.T) {
	mountnstest.RequireRoot(t)
	f := newTargetsFixture(t)
	k := f.kubelet
	if err := os.Mkdir(filepath.Join(k, "mnt"), 0o750); err != nil {
		t.Fatal(err)
	}
	mountTmpfs(t, "t", filepath.Join(k, "mnt"))
	mountTmpfs(t, "t", filepath.Join(f.outside, "empty")) // a mount the symlink leads to
	if err := unix.Mknod(filepath.Join(k, "dev"), unix.S_IFBLK|0o600, int(unix.Mkdev(7, 250))); err != nil {
		t.Fatal(err)
	}
	rows := []struct {
		name    string
		target  string
		want    mounter.Target
		wantErr error
	}{
		{"a tmpfs mount point", "mnt", mounter.Target{Parent: true, Exists: true, Mounted: true}, nil},
		{"a directory", "dir", mounter.Target{Parent: true, Exists: true}, nil},
		{"an empty file", "file", mounter.Target{Parent: true, Exists: true}, nil},
		{"a block device node", "dev", mounter.Target{Parent: true, Exists: true, Device: &mounter.Device{Major: 7, Minor: 250}}, nil},
		{"missing, its parent there", "dir/missing", mounter.Target{Parent: true}, nil},
		{"missing, and its parent", "missing/mount", mounter.Target{}, nil},
		{"a symlink (not followed)", "link", mounter.Target{Parent: true, Exists: true}, nil},
		{"through a symlink to a mount point", "link/empty", mounter.Target{}, errdefs.ErrInvalidArgument},
		{"through a file", "file/x", mounter.Target{}, errdefs.ErrInvalidArgument},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			p := filepath.Join(k, r.target)
			got, err := f.n.TargetState(context.Background(), p)
			if r.wantErr != nil {
				if !errors.Is(err, r.wantErr) {
					t.Fatalf("TargetState(%s) = %+v, %v; want %v", p, got, err, r.wantErr)
				}
				return
			}
			if r.want.Device != nil {
				r.want.Device.Path = p
			}
			if err != nil || !sameTarget(got, r.want) {
				t.Fatalf("TargetState(%s) = %+v (device %+v), %v; want %+v (device %+v)", p, got, got.Device, err, r.want, r.want.Device)
			}
		})
	}
	if _, err := f.n.TargetState(context.Background(), filepath.Join(f.outside, "empty")); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("TargetState outside the kubelet dir = %v, want PermissionDenied", err)
	}
}

func sameTarget(a, b mounter.Target) bool {
	if (a.Device == nil) != (b.Device == nil) || (a.Device != nil && *a.Device != *b.Device) {
		return false
	}
	a.Device, b.Device = nil, nil
	return a == b
}

// TestStatTarget measures a tmpfs mounted at a target, and nothing else:
// not a directory that is no mount point, not a mount a symlink leads to.
func TestStatTarget(t *testing.T) {
	mountnstest.RequireRoot(t)
	f := newTargetsFixture(t)
	mnt := filepath.Join(f.kubelet, "mnt")
	if err := os.Mkdir(mnt, 0o750); err != nil {
		t.Fatal(err)
	}
	// Sized, so that the answer cannot be another filesystem's.
	if err := unix.Mount("t", mnt, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=4m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	mountTmpfs(t, "t", filepath.Join(f.outside, "empty"))
	ctx := context.Background()
	u, err := f.n.StatTarget(ctx, mnt)
	if err != nil || u.TotalBytes != 4<<20 {
		t.Fatalf("StatTarget of a 4 MiB tmpfs = %+v, %v", u, err)
	}
	for _, tt := range []struct {
		p    string
		want error
	}{
		{filepath.Join(f.kubelet, "dir"), errdefs.ErrNotFound},
		{filepath.Join(f.kubelet, "link", "empty"), errdefs.ErrInvalidArgument},
		{filepath.Join(f.kubelet, "link"), errdefs.ErrNotFound},
		{filepath.Join(f.outside, "empty"), errdefs.ErrPermissionDenied},
	} {
		if u, err := f.n.StatTarget(ctx, tt.p); !errors.Is(err, tt.want) {
			t.Errorf("StatTarget(%s) = %+v, %v; want %v", tt.p, u, err, tt.want)
		}
	}
}
