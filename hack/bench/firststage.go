package main

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Names of the steps of measurement 6, used by the summary too.
const (
	stepCreate     = "CreateVolume (64 MiB, mount access: ext4 made at create)"
	stepFirstStage = "first NodeStageVolume of the fresh volume"
	stepLaterStage = "later NodeStageVolume of the same volume"
	stepDelete     = "DeleteVolume (unstaged)"
)

// measureFirstStage times, for fresh volumes one after another:
// CreateVolume, the first stage, an unstage, a later stage, an unstage and
// DeleteVolume. First and later stages thus alternate volume by volume.
// Each step goes into a sample of its own (numbered 6 to 9) so that the
// summary can compare the first stage with the later one.
func (b *bench) measureFirstStage(ctx context.Context, res *results) error {
	create, first := newSample(6, stepCreate), newSample(7, stepFirstStage)
	later, del := newSample(8, stepLaterStage), newSample(9, stepDelete)
	rounds := max(b.o.n/5, 5)
	b.logf("measurement 6: %d fresh volumes after %d warm-ups", rounds, b.o.warmup)
	for i := -b.o.warmup; i < rounds; i++ {
		rec := func(s *sample) *sample { // warm-ups record nothing
			if i < 0 {
				return nil
			}
			return s
		}
		if err := b.freshVolume(ctx, fmt.Sprintf("mpbench-fresh-%d", i+b.o.warmup),
			rec(create), rec(first), rec(later), rec(del)); err != nil {
			return fmt.Errorf("measurement 6, volume %d: %w", i+b.o.warmup, err)
		}
	}
	res.samples = append(res.samples, create, first, later, del)
	return nil
}

// freshVolume does one round of measurement 6 on a new volume called name.
func (b *bench) freshVolume(ctx context.Context, name string, create, first, later, del *sample) error {
	timed := func(s *sample, fn func() error) error {
		t := time.Now()
		err := fn()
		if err == nil && s != nil {
			s.add(s.name, time.Since(t))
			s.addTotal(time.Since(t))
		}
		return err
	}
	stageReq := func() *csi.NodeStageVolumeRequest {
		return &csi.NodeStageVolumeRequest{VolumeId: b.freshID, StagingTargetPath: b.staging, VolumeCapability: mountCap()}
	}
	unstage := func() error {
		_, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: b.freshID, StagingTargetPath: b.staging})
		return err
	}
	if err := timed(create, func() error {
		r, err := b.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name:               name,
			CapacityRange:      &csi.CapacityRange{RequiredBytes: imageSize},
			VolumeCapabilities: []*csi.VolumeCapability{mountCap()},
		})
		if err == nil {
			b.freshID = r.GetVolume().GetVolumeId()
		}
		return err
	}); err != nil {
		return fmt.Errorf("CreateVolume: %w", err)
	}
	for _, s := range []*sample{first, later} {
		if err := timed(s, func() error { _, err := b.node.NodeStageVolume(ctx, stageReq()); return err }); err != nil {
			return fmt.Errorf("NodeStageVolume: %w", err)
		}
		if err := unstage(); err != nil {
			return fmt.Errorf("NodeUnstageVolume: %w", err)
		}
	}
	if err := timed(del, func() error {
		_, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: b.freshID})
		return err
	}); err != nil {
		return fmt.Errorf("DeleteVolume: %w", err)
	}
	b.freshID = ""
	return nil
}
