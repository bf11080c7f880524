package driver

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/testenv"
)

// BenchmarkPublishCycleInProcess times NodePublishVolume + NodeUnpublishVolume
// of a staged ext4 loop volume without the socket, for CPU profiles of the
// driver's own overhead (go test -bench PublishCycle -cpuprofile ...).
func BenchmarkPublishCycleInProcess(b *testing.B) {
	testenv.RequireRoot(b)
	dir, err := os.MkdirTemp("/var/tmp", "mp-driver-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	d := benchDriver(b, dir, 64<<20)
	ctx := context.Background()
	stage := &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: dir + "/s", VolumeCapability: rwo}
	if _, err := d.NodeStageVolume(ctx, stage); err != nil {
		b.Fatal(err)
	}
	target := dir + "/t"
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: dir + "/s", TargetPath: target, VolumeCapability: rwo}); err != nil {
			b.Fatal(err)
		}
		if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: dir + "/s"}); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkNodeCycleInProcess times the whole publish cycle (stage,
// publish, unpublish, unstage) of an ext4 loop volume without the socket,
// for CPU profiles of what the driver and its in-process mounter spend
// beside the kernel's work (issue 23: go test -run '^$' -bench
// NodeCycleInProcess -cpuprofile cpu.out ./internal/driver).
func BenchmarkNodeCycleInProcess(b *testing.B) {
	testenv.RequireRoot(b)
	dir, err := os.MkdirTemp("/var/tmp", "mp-driver-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	d := benchDriver(b, dir, 64<<20)
	ctx := context.Background()
	staging, target := dir+"/s", dir+"/t"
	for b.Loop() {
		if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
			b.Fatal(err)
		}
		if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: rwo}); err != nil {
			b.Fatal(err)
		}
		if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}); err != nil {
			b.Fatal(err)
		}
		if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSnapshot times CreateSnapshot of a published 1 GiB ext4 volume
// holding 100 MiB of data (frozen for the copy) with the state dir on xfs,
// where the image is reflinked, and on ext4, where its data extents are
// copied (make bench runs it; DeleteSnapshot is outside the timer).
func BenchmarkSnapshot(b *testing.B) {
	testenv.RequireRoot(b)
	testenv.RequireCommands(b, "mkfs.xfs", "mkfs.ext4", "losetup")
	for _, tc := range []struct{ name, backing string }{{"reflink", "xfs"}, {"copy", "ext4"}} {
		b.Run(tc.name, func(b *testing.B) {
			dir := benchBacking(b, tc.backing)
			d := benchDriver(b, dir, 1<<30)
			ctx := context.Background()
			staging, target := filepath.Join(dir, "s"), filepath.Join(dir, "t")
			if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
				b.Fatal(err)
			}
			defer func() {
				_, _ = d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target})
				_, _ = d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging})
			}()
			if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: rwo}); err != nil {
				b.Fatal(err)
			}
			data := make([]byte, 100<<20)
			for i := range data {
				data[i] = byte(i>>9) | 1 // no zero block: every extent is data
			}
			if err := os.WriteFile(filepath.Join(target, "data"), data, 0o600); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "v"}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if _, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "s"}); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// benchDriver makes an in-process driver (plans performed by its own
// executor) with its state and kubelet dirs under dir, and an ext4 volume
// "v" of size bytes.
func benchDriver(b *testing.B, dir string, size int64) *Driver {
	b.Helper()
	cfg := &config.Config{DefaultFsType: "ext4"}
	state := filepath.Join(dir, "state")
	d, err := New(testOptions(b, Options{DriverName: "x.csi.io", NodeID: "n", StateDir: state, KubeletDir: dir, Config: cfg}))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: size}}); err != nil {
		b.Fatal(err)
	}
	return d
}

// benchBacking returns a directory on a fresh fsType filesystem of 3 GiB
// (a sparse image on a loop device), removed at the end of b.
func benchBacking(b *testing.B, fsType string) string {
	b.Helper()
	dir, err := os.MkdirTemp("/var/tmp", "mp-snap-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	img := filepath.Join(dir, "backing.img")
	run := func(name string, args ...string) string {
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			b.Fatalf("%s %v: %v: %s", name, args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	run("truncate", "-s", "3G", img)
	run("mkfs."+fsType, "-q", img)
	dev := run("losetup", "--find", "--show", img)
	b.Cleanup(func() { run("losetup", "--detach", dev) })
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		b.Fatal(err)
	}
	if err := unix.Mount(dev, mnt, fsType, 0, ""); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			b.Errorf("unmount %s: %v", mnt, err)
		}
	})
	return mnt
}
