//go:build linux

package service_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// serve runs a node over state on a socket until the test ends and
// returns the plugin's client of it.
func serve(t *testing.T, state string) *service.Client {
	t.Helper()
	return serveWith(t, mounter.Options{StateDir: state, KubeletDir: state,
		RecordsDir: filepath.Join(t.TempDir(), "records"), Config: &config.Config{}})
}

// TestThroughTheSocket has a volume's whole life cross the socket, as the
// plugin lives it: attach, format, detect, mount in a consumer's
// namespace, unmount, detach; and the mounter's refusals arrive with their
// sentinels.
func TestThroughTheSocket(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "mkfs.ext4", "blkid")
	dir := mountnstest.Scratch(t)
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(filepath.Join(state, "images"), 0o700); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(state, "images", "v.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	c := serve(t, state)
	ctx := context.Background()
	l, err := c.AttachLoop(ctx, mounter.LoopRequest{Image: img, DirectIO: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.DetachLoop(ctx, l.Identity); err != nil {
			t.Error(err)
		}
	}()
	if got, err := c.AdoptLoop(ctx, l.Identity); err != nil || got.Identity != l.Identity {
		t.Fatalf("AdoptLoop = %+v, %v", got, err)
	}
	if fs, err := c.Detect(ctx, l.Device); err != nil || fs != "" {
		t.Fatalf("Detect of a blank device = %q, %v", fs, err)
	}
	if err := c.Format(ctx, l.Device, "ext4"); err != nil {
		t.Fatal(err)
	}
	if fs, err := c.Detect(ctx, l.Device); err != nil || fs != "ext4" {
		t.Fatalf("Detect after Format = %q, %v", fs, err)
	}
	// StatDevice measures the filesystem mounted nowhere, through a
	// private mount it removes again (Scratch's cleanup finds any left).
	if u, err := c.StatDevice(ctx, l.Device, true); err != nil || u.TotalBytes <= 16<<20 || u.TotalBytes > 32<<20 || u.UsedBytes <= 0 {
		t.Fatalf("StatDevice of a fresh 32 MiB ext4 = %+v, %v", u, err)
	}
	pid := mountnstest.Namespace(t, "private")
	mounts := []plan.Mount{{Type: "ext4", Source: l.Path, Options: []string{"nosuid", "nodev"}}}
	cons := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	if err := c.Mount(ctx, mounts, cons); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 1 {
		t.Fatalf("%d mounts in the consumer, want 1", n)
	}
	if err := c.Unmount(ctx, mounts, cons); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 0 {
		t.Fatalf("%d mounts left in the consumer", n)
	}

	for _, tt := range []struct {
		name string
		call func() error
		want error
	}{
		{"a target with ..", func() error {
			return c.Mount(ctx, []plan.Mount{{Type: "tmpfs", Source: "x", Target: "../up", Options: []string{"nosuid", "nodev"}}}, cons)
		}, errdefs.ErrInvalidArgument},
		{"a consumer that does not exist", func() error {
			return c.Mount(ctx, mounts, plan.Consumer{PID: 1<<22 + 1, MountPoint: cons.MountPoint})
		}, errdefs.ErrNotFound},
		{"an image outside the image roots", func() error {
			_, err := c.AttachLoop(ctx, mounter.LoopRequest{Image: "/etc/passwd"})
			return err
		}, errdefs.ErrPermissionDenied},
		{"a device the mounter did not set up", func() error {
			return c.Format(ctx, mounter.Device{Path: "/dev/null", Major: 1, Minor: 3}, "ext4")
		}, errdefs.ErrPermissionDenied},
		{"statfs of a device the mounter did not set up", func() error {
			_, err := c.StatDevice(ctx, mounter.Device{Path: "/dev/null", Major: 1, Minor: 3}, true)
			return err
		}, errdefs.ErrPermissionDenied},
		{"a loop device it does not hold", func() error {
			_, err := c.ResizeLoop(ctx, l.Identity)
			if err != nil {
				return err
			}
			id := l.Identity
			id.BackingIno++
			_, err = c.AdoptLoop(ctx, id)
			return err
		}, errdefs.ErrNotFound},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.call(); !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
}

// TestUnreachable: a mounter that is not there is Unavailable, not a
// hang and not Internal.
func TestUnreachable(t *testing.T) {
	c := service.NewClient(filepath.Join(t.TempDir(), "none.sock"))
	defer c.Close()
	if _, err := c.IdentifyNamespace(context.Background(), os.Getpid()); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("IdentifyNamespace with no mounter = %v, want Unavailable", err)
	}
}
