package driver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/loop"
)

// thawFails is the loop source with a thaw that fails after a freeze
// succeeded: the source stays frozen, as when FITHAW or the scratch
// unmount fails for real.
type thawFails struct{ *loop.Source }

func (s thawFails) Freeze(ctx context.Context, v source.Volume) (func() error, error) {
	if _, err := s.Source.Freeze(ctx, v); err != nil {
		return nil, err
	}
	return func() error { return errors.New("injected: FITHAW failed") }, nil
}

// TestCopyWhoseThawFailed: a snapshot and a clone of a published volume
// whose thaw fails keep their records (Creating, Frozen) and answer an
// error; the retry of the same call then thaws the source and succeeds,
// and the source's filesystem takes writes again.
func TestCopyWhoseThawFailed(t *testing.T) {
	d, kubelet := newRootDriver(t)
	ctx := context.Background()
	if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "src", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}}); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(kubelet, "plugins/mountplan/src/globalmount")
	target := filepath.Join(kubelet, "pods/p/volumes/src/mount")
	for _, dir := range []string{staging, filepath.Dir(target)} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "src", StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "src", StagingTargetPath: staging, TargetPath: target, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "src", TargetPath: target})
		_, _ = d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "src", StagingTargetPath: staging})
		_, _ = d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "src"})
	})
	real := d.sources[loop.Type].(*loop.Source)

	copies := []struct {
		name   string
		create func() error
		record func() (creating, frozen bool, err error)
		remove func()
	}{
		{"snapshot", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: "src"})
			return err
		}, func() (bool, bool, error) {
			s, err := d.records.Snapshot("snap")
			if err != nil {
				return false, false, err
			}
			return s.Creating, s.Frozen, nil
		}, func() { _, _ = d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "snap"}) }},
		{"clone", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "clone", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				VolumeContentSource: fromVolume("src")})
			return err
		}, func() (bool, bool, error) {
			v, err := d.records.Get("clone")
			if err != nil {
				return false, false, err
			}
			return v.Creating, v.ContentSource != nil && v.ContentSource.Frozen, nil
		}, func() { _, _ = d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "clone"}) }},
	}
	// A copy whose thaw failed is ended either by the retry of the same
	// call or by a delete of the copy: both must thaw the source.
	for _, c := range copies {
		for _, end := range []string{"retry", "delete"} {
			t.Run(c.name+"/"+end, func(t *testing.T) {
				d.sources[loop.Type] = thawFails{real}
				err := c.create()
				d.sources[loop.Type] = real
				t.Cleanup(c.remove)
				if err == nil || errdefs.Code(err) == 0 {
					t.Fatalf("%s whose thaw failed: %v, want an error", c.name, err)
				}
				creating, frozen, rerr := c.record()
				if rerr != nil || !creating || !frozen {
					t.Fatalf("after the failed thaw the record is (creating %v, frozen %v, %v), want kept as creating and frozen", creating, frozen, rerr)
				}
				if end == "retry" {
					if err := c.create(); err != nil {
						t.Fatalf("the retry: %v", err)
					}
					if creating, frozen, rerr = c.record(); rerr != nil || creating || frozen {
						t.Fatalf("after the retry the record is (creating %v, frozen %v, %v), want done", creating, frozen, rerr)
					}
				} else {
					c.remove()
					if _, _, rerr = c.record(); !errors.Is(rerr, errdefs.ErrNotFound) {
						t.Fatalf("after the delete the record reads %v, want not found", rerr)
					}
				}
				wantWritable(t, filepath.Join(target, c.name+"-"+end), func() error { return d.thawSource(ctx, "src") })
			})
		}
	}
}

// wantWritable fails t when a write to the new file p does not reach its
// filesystem within 30 s: a write blocks on a frozen filesystem and goes
// through on a thawed one, and syncfs makes it reach the filesystem.
// thaw then ends the freeze, so that the failure ends the test instead of
// hanging its cleanup (and the blocked writer).
func wantWritable(t *testing.T, p string, thaw func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		f, err := os.Create(p)
		if err == nil {
			err = errors.Join(unix.Syncfs(int(f.Fd())), f.Close())
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		thawErr := thaw()
		<-done
		t.Fatalf("a write to %s blocked: its filesystem was left frozen (thawed by the test: %v)", p, thawErr)
	}
}
