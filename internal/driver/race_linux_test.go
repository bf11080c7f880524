package driver

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/volview"
	"github.com/mountplan/mountplan/test/testutil"
)

// raceVolume is one volume the writers cycle and what they say of it.
// published is set after a publish returned and cleared before the
// unpublish starts; staged likewise around stage and unstage; epoch
// counts both changes, so a reader knows whether a state held for the
// whole of its call.
type raceVolume struct {
	id, staging, target string
	published, staged   atomic.Bool
	epoch               atomic.Int64
}

// newRootDriver makes a driver whose mounts are real (an in-process
// mounter.Executor) with ext4 as the default filesystem, under a temp dir,
// for root tests that check afterwards that nothing leaked. It returns the
// driver and kubelet's directory.
func newRootDriver(t *testing.T) (*Driver, string) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	testutil.NoLeaks(t)
	base := t.TempDir()
	kubelet := filepath.Join(base, "kubelet")
	cfg := &config.Config{DefaultFsType: "ext4"}
	state := filepath.Join(base, "state")
	d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "n", StateDir: state, KubeletDir: kubelet, Config: cfg}))
	if err != nil {
		t.Fatal(err)
	}
	return d, kubelet
}

// TestReadsDuringStateChanges hammers NodeGetVolumeStats,
// NodeGetVolumeHealth, the staged-volume gauge and the record itself while
// writers stage, publish, unpublish and unstage the same volumes (real
// loop devices and mounts; run it with -race). Readers must never get an
// error other than NotFound for a volume that is not published at that
// moment, never a stale answer (a volume published for the whole of a
// stats call is found), and never a torn record.
func TestReadsDuringStateChanges(t *testing.T) {
	const nVols, cycles, nReaders = 4, 25, 4
	d, kubelet := newRootDriver(t)
	ctx := context.Background()
	vols := make([]*raceVolume, nVols)
	for i := range vols {
		v := &raceVolume{id: "race-" + strconv.Itoa(i),
			staging: filepath.Join(kubelet, "plugins/mountplan/race-"+strconv.Itoa(i)+"/globalmount"),
			target:  filepath.Join(kubelet, "pods/p"+strconv.Itoa(i)+"/volumes/v/mount")}
		if err := os.MkdirAll(filepath.Dir(v.target), 0o750); err != nil {
			t.Fatal(err)
		}
		if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: v.id, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}}); err != nil {
			t.Fatal(err)
		}
		vols[i] = v
	}
	t.Cleanup(func() {
		for _, v := range vols {
			_, _ = d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
			_, _ = d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
			if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id}); err != nil {
				t.Errorf("delete %s: %v", v.id, err)
			}
		}
	})

	var reads, stableFound atomic.Int64
	done := make(chan struct{})
	var readers sync.WaitGroup
	for r := range nReaders {
		readers.Add(1)
		go func() {
			defer readers.Done()
			rnd := rand.New(rand.NewPCG(uint64(r), 1))
			for {
				select {
				case <-done:
					return
				default:
				}
				v := vols[rnd.IntN(nVols)]
				if err := readOnce(d, v, nVols, &stableFound); err != nil {
					t.Error(err)
					return
				}
				reads.Add(1)
			}
		}()
	}

	start := time.Now()
	var writers sync.WaitGroup
	for _, v := range vols {
		writers.Add(1)
		go func() {
			defer writers.Done()
			for c := range cycles {
				if err := cycle(d, v); err != nil {
					t.Errorf("%s cycle %d: %v", v.id, c, err)
					return
				}
			}
		}()
	}
	writers.Wait()
	elapsed := time.Since(start)
	close(done)
	readers.Wait()
	t.Logf("%d volumes × %d stage/publish/unpublish/unstage cycles in %v; %d concurrent reads (stats, health, gauge, record, listing), %d of them during a publish that held for the whole call",
		nVols, cycles, elapsed.Round(time.Millisecond), reads.Load(), stableFound.Load())
	if stableFound.Load() == 0 {
		t.Error("no read fell inside a publish: the test proved nothing")
	}
}

// cycle stages, publishes, unpublishes and unstages v once, checking
// after each step that the driver's own answers show it at once.
func cycle(d *Driver, v *raceVolume) error {
	ctx := context.Background()
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: rwo}); err != nil {
		return fmt.Errorf("stage: %w", err)
	}
	v.epoch.Add(1)
	v.staged.Store(true)
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		TargetPath: v.target, VolumeCapability: rwo}); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	v.epoch.Add(1)
	v.published.Store(true)
	// The writer's own reads keep the volume published a while.
	for range 10 {
		if _, err := d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target}); err != nil {
			return fmt.Errorf("stats right after publish: %w", err)
		}
	}
	v.published.Store(false)
	v.epoch.Add(1)
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
		return fmt.Errorf("unpublish: %w", err)
	}
	v.staged.Store(false)
	v.epoch.Add(1)
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
		return fmt.Errorf("unstage: %w", err)
	}
	if rec, err := d.records.Get(v.id); err != nil || rec.Stage != nil || len(rec.Publishes) != 0 {
		return fmt.Errorf("record right after unstage: %+v, %v", rec, err)
	}
	return nil
}

// readOnce reads v the five ways (the fifth: the operator's listing) and checks each answer against what the
// writer said held for the whole call.
func readOnce(d *Driver, v *raceVolume, nVols int, stableFound *atomic.Int64) error {
	ctx := context.Background()
	epoch, published, staged := v.epoch.Load(), v.published.Load(), v.staged.Load()
	_, statsErr := d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target})
	_, healthErr := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: v.id})
	gauge := d.StagedByType()["loop"]
	rec, recErr := d.records.Get(v.id)
	list := d.Volumes(ctx)
	held := v.epoch.Load() == epoch
	switch code := errdefs.Code(statsErr); {
	case code != codes.OK && code != codes.NotFound:
		return fmt.Errorf("%s: stats: %v", v.id, statsErr)
	case held && published && code != codes.OK:
		return fmt.Errorf("%s: stats of a volume published for the whole call: %v (stale)", v.id, statsErr)
	case held && published:
		stableFound.Add(1)
	}
	if healthErr != nil {
		return fmt.Errorf("%s: health: %v", v.id, healthErr)
	}
	if gauge < 0 || gauge > nVols {
		return fmt.Errorf("staged gauge %d outside [0, %d]", gauge, nVols)
	}
	if recErr != nil {
		return fmt.Errorf("%s: record: %v", v.id, recErr)
	}
	if rec.ID != v.id || (len(rec.Publishes) > 0 && !rec.Staged()) {
		return fmt.Errorf("%s: torn record %+v", v.id, rec)
	}
	if held && staged && !rec.Staged() {
		return fmt.Errorf("%s: record of a volume staged for the whole call is not staged (stale): %+v", v.id, rec)
	}
	if held && published && findPublish(rec, v.target) == nil {
		return fmt.Errorf("%s: record of a volume published for the whole call lacks the publish (stale): %+v", v.id, rec.Publishes)
	}
	return checkListing(list, v, nVols, held && published)
}

// checkListing checks the operator's listing (driver.Volumes) taken
// during a read: every volume, no error, and v's publish when v was
// published for the whole read.
func checkListing(list *volview.Report, v *raceVolume, nVols int, published bool) error {
	if len(list.Volumes) != nVols || len(list.Errors) != 0 {
		return fmt.Errorf("listing of %d volumes (errors %q), want %d", len(list.Volumes), list.Errors, nVols)
	}
	for _, lv := range list.Volumes {
		if lv.ID != v.id {
			continue
		}
		if published && !slices.ContainsFunc(lv.Consumers, func(c volview.Consumer) bool { return c.Path == v.target }) {
			return fmt.Errorf("%s: listing of a volume published for the whole call lacks the target (stale): %+v", v.id, lv)
		}
		return nil
	}
	return fmt.Errorf("%s: not in the listing", v.id)
}
