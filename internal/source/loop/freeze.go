package loop

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/source"
)

// freezable are the filesystems whose freeze makes the image under them
// consistent on disk (journal flushed, no write in flight).
var freezable = []string{"ext4", "xfs", "btrfs"}

// Freeze freezes the filesystem of the staged v, which its consumers may
// be writing, so that its image can be copied as one point in time; thaw
// undoes it. The mounter reaches the filesystem through a private mount
// of the volume's device: a second mount of a mounted ext4 or xfs is the
// same superblock, whichever mount namespaces its consumers see it in. A
// filesystem someone else froze is refused (thawing it after the copy
// would undo their freeze), and so is one that cannot be frozen.
func (s *Source) Freeze(ctx context.Context, v source.Volume) (thaw func() error, err error) {
	st, err := freezeTarget(v)
	if err != nil {
		return nil, err
	}
	if err := s.Devices.Freeze(ctx, st.device(), st.FsType); err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	klog.FromContext(ctx).V(2).Info("Froze the filesystem for a copy", "volume", v.ID, "device", st.Device)
	return func() error {
		if err := s.Devices.Thaw(context.WithoutCancel(ctx), st.device(), st.FsType); err != nil {
			return fmt.Errorf("volume %s: %w", v.ID, err)
		}
		return nil
	}, nil
}

// Thaw thaws the staged v's filesystem if a copy interrupted by a crash
// left it frozen; a filesystem that is not frozen is left as it is.
func (s *Source) Thaw(ctx context.Context, v source.Volume) error {
	st, err := freezeTarget(v)
	if err != nil {
		return err
	}
	if err := s.Devices.Thaw(ctx, st.device(), st.FsType); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	return nil
}

// freezeTarget returns the state of a staged v whose filesystem freezes.
func freezeTarget(v source.Volume) (State, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return st, err
	}
	if st.Chain != nil || !slices.Contains(freezable, st.FsType) {
		return st, fmt.Errorf("volume %s holds %q, which cannot be frozen for a consistent copy (%s can): %w",
			v.ID, st.FsType, strings.Join(freezable, ", "), errdefs.ErrFailedPrecondition)
	}
	return st, nil
}

// SnapshotImagePath is where snapshot id's image lives.
func (s *Source) SnapshotImagePath(id string) string { return SnapshotImagePath(s.StateDir, id) }

// SnapshotImagePath is where a snapshot's image lives under stateDir.
func SnapshotImagePath(stateDir, id string) string {
	return filepath.Join(stateDir, "images", "snapshots", id+".img")
}

// SnapshotImages lists the snapshot images under the state dir by ID, and
// the temp files of copies a crash interrupted (see TempImages). Only a
// holder of the snapshot's lock may remove them.
func (s *Source) SnapshotImages() (images map[string]string, temps map[string][]string, err error) {
	dir := filepath.Dir(s.SnapshotImagePath("x"))
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, err
	}
	images = map[string]string{}
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".img"); ok && e.Type().IsRegular() && !strings.HasPrefix(id, ".") {
			images[id] = filepath.Join(dir, e.Name())
		}
	}
	raw, err := fsutil.AtomicTemps(dir)
	if err != nil {
		return nil, nil, err
	}
	temps = map[string][]string{}
	for name, paths := range raw {
		if id, ok := strings.CutSuffix(name, ".img"); ok {
			temps[id] = append(temps[id], paths...)
		}
	}
	return images, temps, nil
}
