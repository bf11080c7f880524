//go:build linux

package service_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// TestTargetsThroughTheSocket lives a classic publish's target as the
// plugin, which sees no kubelet dir, asks for it: made, found mounted (a
// tmpfs stands for the volume) and measured, found unmounted, removed; and
// the refusals arrive with their sentinels: a path outside the mounter's
// kubelet dir, one through a symlink planted in it (nothing made where it
// leads).
func TestTargetsThroughTheSocket(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	kubelet, outside := filepath.Join(dir, "kubelet"), filepath.Join(dir, "outside")
	for _, d := range []string{kubelet, outside} {
		if err := os.Mkdir(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(outside, filepath.Join(kubelet, "pods")); err != nil {
		t.Fatal(err)
	}
	c := serveWith(t, mounter.Options{StateDir: filepath.Join(dir, "state"), KubeletDir: kubelet,
		RecordsDir: filepath.Join(t.TempDir(), "records"), Config: &config.Config{}})
	ctx := context.Background()
	target := filepath.Join(kubelet, "plugins/kubernetes.io/csi/pv/mount")

	if created, err := c.MakeTarget(ctx, target, false); err != nil || !created {
		t.Fatalf("MakeTarget = %t, %v", created, err)
	}
	if st, err := c.TargetState(ctx, target); err != nil || !st.Exists || st.Mounted {
		t.Fatalf("TargetState of the new target = %+v, %v", st, err)
	}
	if err := unix.Mount("t", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=2m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(target, unix.MNT_DETACH)
	if st, err := c.TargetState(ctx, target); err != nil || !st.Mounted {
		t.Fatalf("TargetState of a mounted target = %+v, %v", st, err)
	}
	if u, err := c.StatTarget(ctx, target); err != nil || u.TotalBytes != 2<<20 {
		t.Fatalf("StatTarget of a 2 MiB tmpfs = %+v, %v", u, err)
	}
	if err := unix.Unmount(target, 0); err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveTarget(ctx, target); err != nil {
		t.Fatal(err)
	}
	if st, err := c.TargetState(ctx, target); err != nil || st.Exists || !st.Parent {
		t.Fatalf("TargetState after RemoveTarget = %+v, %v; want its parent only", st, err)
	}

	for _, tt := range []struct {
		name string
		call func() error
		want error
	}{
		{"make a target outside the kubelet dir", func() error {
			_, err := c.MakeTarget(ctx, filepath.Join(outside, "mount"), false)
			return err
		}, errdefs.ErrPermissionDenied},
		{"make a target through a symlink", func() error {
			_, err := c.MakeTarget(ctx, filepath.Join(kubelet, "pods/uid/volumes/kubernetes.io~csi/pv/mount"), false)
			return err
		}, errdefs.ErrInvalidArgument},
		{"look through a symlink", func() error {
			_, err := c.TargetState(ctx, filepath.Join(kubelet, "pods/uid"))
			return err
		}, errdefs.ErrInvalidArgument},
		{"measure outside the kubelet dir", func() error {
			_, err := c.StatTarget(ctx, dir)
			return err
		}, errdefs.ErrPermissionDenied},
		{"remove outside the kubelet dir", func() error { return c.RemoveTarget(ctx, outside) }, errdefs.ErrPermissionDenied},
	} {
		if err := tt.call(); !errors.Is(err, tt.want) {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.want)
		}
	}
	if ents, err := os.ReadDir(outside); err != nil || len(ents) != 0 {
		t.Fatalf("something was made outside the kubelet dir: %v %v", ents, err)
	}
}
