//go:build linux

package mounter_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// BenchmarkMountUnmountInNamespace is the whole Executor path for one ext4
// volume: policy, build in the mounter's namespace, setns on a fresh
// thread, mountinfo checks, move_mount, and the same for Unmount.
func BenchmarkMountUnmountInNamespace(b *testing.B) {
	mountnstest.RequireRoot(b)
	dir := mountnstest.Scratch(b)
	e := executor(b, dir)
	dev := volumeDevice(b, e, dir, "ext4", 16)
	pid := mountnstest.Namespace(b, "private")
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	mounts := []plan.Mount{{Type: "ext4", Source: dev, Options: opts()}}
	ctx := context.Background()
	for b.Loop() {
		if err := e.Mount(ctx, mounts, c); err != nil {
			b.Fatal(err)
		}
		if err := e.Unmount(ctx, mounts, c); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRawMountUnmount is the floor: mount(2) and umount2 of the same
// ext4 volume in the benchmark's own namespace.
func BenchmarkRawMountUnmount(b *testing.B) {
	mountnstest.RequireRoot(b)
	dir := mountnstest.Scratch(b)
	dev := mountnstest.LoopDevice(b, dir, "ext4", 16)
	mp := filepath.Join(dir, "mp")
	if err := os.Mkdir(mp, 0o750); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := unix.Mount(dev, mp, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			b.Fatal(err)
		}
		if err := unix.Unmount(mp, 0); err != nil {
			b.Fatal(err)
		}
	}
}
