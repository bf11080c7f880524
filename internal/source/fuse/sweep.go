package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/internal/source"
)

// Run sweeps orphans at once and then every interval until ctx ends; then
// it stops supervising (the daemons keep running, for the next plugin to
// adopt). The driver's reconcile adopts the volumes that have records.
func (s *Source) Run(ctx context.Context, interval time.Duration) {
	defer s.stop()
	sweep := func(ctx context.Context) bool {
		if err := s.Sweep(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "FUSE orphan sweep left errors")
		}
		return true
	}
	sweep(ctx)
	periodic.Every(ctx, interval, sweep)
}

// Sweep tears down what lies under <state-dir>/fuse (its entries, and the
// mounts the plugin's mount table shows there) without a staged fuse
// record: the mounter aborts its FUSE connections, lazily unmounts its
// mounts and removes its files (StopDaemons with teardown). It asks the
// driver (Host) about each volume, holding the volume's lock as any
// operation on it does, so a stage in flight is never taken for an
// orphan.
func (s *Source) Sweep(ctx context.Context) error {
	host := s.getHost()
	if host == nil {
		return fmt.Errorf("fuse: no driver to ask which volumes are staged: %w", errdefs.ErrFailedPrecondition)
	}
	root, err := s.root()
	if err != nil {
		return err
	}
	ids := map[string]bool{}
	ents, err := os.ReadDir(root)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, e := range ents {
		ids[e.Name()] = true
	}
	// A mount whose directory entry is somehow gone from the listing
	// still names its volume.
	mounts, err := mountns.MountsUnder(root)
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if rel, ok := strings.CutPrefix(m.Mountpoint, root+"/"); ok {
			ids[strings.SplitN(rel, "/", 2)[0]] = true
		}
	}
	var errs []error
	for id := range ids {
		if model.ValidID(id) != nil {
			klog.FromContext(ctx).Info("Leaving alone an entry that is not a volume's", "path", filepath.Join(root, id))
			continue
		}
		errs = append(errs, host.WithVolume(ctx, id, "fuse-sweep", func(v source.Volume, found bool, _ source.Recorder) error {
			if found && v.Type == Type && v.Staging {
				return nil // staged, or a step in flight: Adopt and Unstage own it
			}
			return s.sweepOne(ctx, id)
		}))
	}
	return errors.Join(errs...)
}

func (s *Source) sweepOne(ctx context.Context, id string) error {
	klog.FromContext(ctx).Info("Tearing down an orphaned FUSE volume", "volume", id)
	m, err := s.mounter()
	if err != nil {
		return err
	}
	// The mounter aborts the connections first, which also ends a daemon
	// that is recorded nowhere.
	return m.StopDaemons(ctx, id, nil, true)
}
