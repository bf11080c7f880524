package driver

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/imagecopy"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// needsFreeze decides how the image of v (its lock held) can be copied
// as one point in time. Nothing writes to it while it is not staged,
// staged read-only, or staged but neither published nor prepared; a
// filesystem in use is frozen for the copy; a raw block device in use
// cannot be made consistent by the plugin and is refused.
func needsFreeze(v *model.Volume) (bool, error) {
	switch {
	case v.Stage == nil:
		return false, nil
	case !v.Staged():
		return false, fmt.Errorf("volume %s is being %s: %w", v.ID, v.Stage.Phase, errdefs.ErrAborted)
	case v.Stage.ReadOnly || len(v.Publishes)+len(v.Consumers) == 0:
		return false, nil
	case v.Stage.Block:
		return false, fmt.Errorf("volume %s is in use as a raw block device, which cannot be frozen: "+
			"a consistent copy needs it unpublished (or published read-only): %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	return true, nil
}

// copyVolumeImage copies the image of the provisioned volume v, whose lock
// the caller holds, to dst with size bytes (at least v's). When a
// consumer may be writing to v, its filesystem is frozen for the copy;
// markFrozen is called first to record durably that it may be frozen, so
// that a crash during the copy is followed by a thaw (thawSource). A copy
// of a frozen xfs has its log replayed (see loop.RecoverCopy), so that it
// is a clean filesystem, unless the caller replays it itself (recover is
// false).
func (d *Driver) copyVolumeImage(ctx context.Context, v *model.Volume, dst string, size int64, recover bool, markFrozen func() error) (imagecopy.Method, error) {
	freeze, err := needsFreeze(v)
	if err != nil {
		return "", err
	}
	if !freeze {
		return copyImage(ctx, v.Image, dst, size)
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return "", err
	}
	fr, ok := src.(source.Snapshotter)
	if !ok {
		return "", fmt.Errorf("%s volumes cannot be frozen for a consistent copy: %w", v.Type, errdefs.ErrFailedPrecondition)
	}
	if err := markFrozen(); err != nil {
		return "", err
	}
	thaw, err := fr.Freeze(ctx, viewOf(v))
	if err != nil {
		return "", err
	}
	method, err := copyImage(ctx, v.Image, dst, size)
	if terr := thaw(); terr != nil {
		return "", errors.Join(err, fmt.Errorf("%w: %w", errMayBeFrozen, terr))
	}
	if err != nil || !recover {
		return method, err
	}
	return method, fr.RecoverCopy(ctx, dst)
}

// errMayBeFrozen marks a copy whose thaw of its source failed: the source
// may still be frozen, so the record that says so (Creating, Frozen) must
// stay for the reconciler or a retry to thaw it (see thawSource).
var errMayBeFrozen = errors.New("the source's filesystem may still be frozen")

// copyImage copies an image, marking a full disk as resource exhausted.
func copyImage(ctx context.Context, src, dst string, size int64) (imagecopy.Method, error) {
	m, err := imagecopy.File(ctx, src, dst, imagecopy.Options{Size: size})
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		err = fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
	}
	return m, err
}

// thawSource thaws the filesystem of volume id if a copy interrupted by a
// crash left it frozen. Background work: it waits for the volume's lock.
func (d *Driver) thawSource(ctx context.Context, id string) error {
	unlock, err := d.records.Lock(ctx, id, "thaw")
	if err != nil {
		return err
	}
	defer unlock()
	v, err := d.records.Get(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if !v.Staged() || v.Stage.Block || v.Stage.ReadOnly {
		return nil // never frozen, or its mounts went with a reboot
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return err
	}
	fr, ok := src.(source.Snapshotter)
	if !ok {
		return nil
	}
	if err := d.adopt(ctx, v, src); err != nil {
		return err
	}
	return fr.Thaw(ctx, viewOf(v))
}
