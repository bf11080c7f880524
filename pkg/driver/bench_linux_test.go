package driver

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/mounter"
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
	cfg := &config.Config{DefaultFsType: "ext4"}
	state := filepath.Join(dir, "state")
	d, err := New(Options{DriverName: "x.csi.io", NodeID: "n", StateDir: state, KubeletDir: dir, Config: cfg, Mounter: &mounter.Executor{Policy: cfg.PlanPolicy(state), KubeletDir: dir}})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}}); err != nil {
		b.Fatal(err)
	}
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
