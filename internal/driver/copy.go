package driver

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/imagecopy"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// content is what a new volume is copied from: a snapshot's image or
// another volume's, with what is known of the filesystem in it.
type content struct {
	record *model.ContentSource
	image  string
	size   int64
	format *model.Format
	// volume is the source volume of a clone (its lock held), nil for a
	// snapshot.
	volume *model.Volume
}

// createFromContent makes volume id, whose lock the caller holds and which
// has no record, as a copy of a snapshot or of another volume (a clone),
// by the same copy as snapshots (see copyVolumeImage). A bigger size
// than the source's grows the image now and its filesystem at the first
// stage (GrowFilesystem).
func (d *Driver) createFromContent(ctx context.Context, id string, req *csi.CreateVolumeRequest, p createParams) (*model.Volume, error) {
	sn, ok := p.prov.(source.Snapshotter)
	if !ok {
		return nil, invalid("%s volumes cannot be made as a copy of a snapshot or a volume", p.typ)
	}
	c, unlock, err := d.lockContent(id, req.GetVolumeContentSource())
	defer unlock()
	if err != nil {
		return nil, err
	}
	size, fsType, err := contentParams(req, p, c)
	if err != nil {
		return nil, err
	}
	if err := d.checkFits(id, size); err != nil {
		return nil, err
	}
	v := &model.Volume{ID: id, Kind: model.KindProvisioned, Type: p.typ,
		Image: sn.ImagePath(model.KindProvisioned, id), CapacityBytes: size,
		FsType: fsType, Parameters: maps.Clone(req.GetParameters()), Creating: true,
		ContentSource: c.record, Format: c.format, GrowFilesystem: c.format != nil && size > c.size}
	if err := d.records.Put(v, journal.Durable); err != nil {
		return nil, err
	}
	var method imagecopy.Method
	if c.volume != nil {
		markFrozen := func() error {
			v.ContentSource.Frozen = true
			return d.records.Put(v, journal.Durable)
		}
		method, err = d.copyVolumeImage(ctx, c.volume, v.Image, size, false, markFrozen)
	} else {
		method, err = copyImage(ctx, c.image, v.Image, size)
	}
	if err == nil && c.format != nil {
		err = cleanCopy(ctx, sn, v.Image, c.format.FsType)
	}
	if err != nil {
		// No record outlives a failed create: the name stays free.
		err = fmt.Errorf("create %s from %s: %w", id, describeContent(c.record), err)
		if errors.Is(err, errMayBeFrozen) {
			// The record (Creating, ContentSource.Frozen) stays: whoever
			// undoes it (a retry, the reconciler) thaws the source first.
			return nil, err
		}
		return nil, errors.Join(err, sn.RemoveImage(v.Image), d.records.Delete(id, journal.Durable))
	}
	klog.FromContext(ctx).V(2).Info("Copied the image", "from", describeContent(c.record), "method", method)
	v.Creating, v.ContentSource.Frozen = false, false
	if err := d.records.Put(v, journal.Durable); err != nil {
		return nil, err
	}
	return v, nil
}

// cleanCopy makes the filesystem in a new volume's copy mountable beside
// its source: an xfs's log replayed, whether the copy was taken frozen or
// its source's log was left dirty by a crash of its node (xfs_admin
// refuses a dirty log), then a UUID of its own.
func cleanCopy(ctx context.Context, sn source.Snapshotter, image, fsType string) error {
	if err := sn.RecoverCopy(ctx, image); err != nil {
		return err
	}
	return fsutil.NewUUID(ctx, image, fsType)
}

// lockContent finds and locks the source of a new volume: a snapshot (its
// lock) or another provisioned volume (its lock). Missing ones are
// NotFound. The returned func is never nil.
func (d *Driver) lockContent(id string, cs *csi.VolumeContentSource) (*content, func(), error) {
	none := func() {}
	if ref := cs.GetSnapshot().GetSnapshotId(); ref != "" {
		snapID, elsewhere := d.localSnapshot(ref)
		if model.ValidID(snapID) != nil {
			return nil, none, fmt.Errorf("snapshot %s: %w", ref, errdefs.ErrNotFound)
		}
		if elsewhere != "" {
			return nil, none, d.snapshotElsewhere(ref, elsewhere)
		}
		unlock, err := d.records.TryLockSnapshot(snapID, "CreateVolume")
		if err != nil {
			return nil, none, err
		}
		snap, err := d.records.Snapshot(snapID)
		if err == nil && snap.Creating {
			err = fmt.Errorf("snapshot %s: %w", snapID, errdefs.ErrNotFound)
		}
		if err != nil {
			return nil, unlock, err
		}
		// The ID as the CO gave it: a retried CreateVolume compares it.
		return &content{record: &model.ContentSource{Snapshot: ref}, image: snap.Image, size: snap.SizeBytes, format: snap.Format}, unlock, nil
	}
	volID := cs.GetVolume().GetVolumeId()
	if volID == "" {
		return nil, none, invalid("volume_content_source names neither a snapshot nor a volume")
	}
	if volID == id {
		return nil, none, invalid("volume %s cannot be a clone of itself", id)
	}
	v, unlock, err := d.sourceVolume(volID, "CreateVolume")
	if err != nil {
		return nil, unlock, err
	}
	c := &content{record: &model.ContentSource{Volume: volID}, image: v.Image, size: v.CapacityBytes, volume: v}
	if v.Format != nil && v.Format.Done {
		f := *v.Format
		c.format = &f
	}
	return c, unlock, nil
}

// contentParams decides the size and filesystem of a volume copied from c:
// at least the source's size (a smaller range is OutOfRange), and the
// source's filesystem when it has one (asking for another is an error:
// the copy holds what it holds).
func contentParams(req *csi.CreateVolumeRequest, p createParams, c *content) (int64, string, error) {
	fsType := p.fsType
	if c.format != nil {
		if want := requestedFsType(req); want != "" && want != c.format.FsType {
			return 0, "", invalid("the source holds %s; a copy of it cannot be %s", c.format.FsType, want)
		}
		fsType = c.format.FsType
	}
	r := req.GetCapacityRange()
	required, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	if required < 0 || limit < 0 {
		return 0, "", fmt.Errorf("capacity range must not be negative: %w", errdefs.ErrOutOfRange)
	}
	if required > 0 && required < c.size {
		return 0, "", fmt.Errorf("required_bytes %d is less than the source's %d bytes: %w", required, c.size, errdefs.ErrOutOfRange)
	}
	if limit > 0 && limit < c.size {
		return 0, "", fmt.Errorf("limit_bytes %d is less than the source's %d bytes: %w", limit, c.size, errdefs.ErrOutOfRange)
	}
	size, err := capacityFor(&csi.CapacityRange{RequiredBytes: max(required, c.size), LimitBytes: limit}, fsType)
	return size, fsType, err
}

// requestedFsType is the filesystem a request names itself, if any.
func requestedFsType(req *csi.CreateVolumeRequest) string {
	for _, k := range []string{paramFsType, paramCSIFsType} {
		if fs := req.GetParameters()[k]; fs != "" {
			return fs
		}
	}
	for _, c := range req.GetVolumeCapabilities() {
		if fs := c.GetMount().GetFsType(); fs != "" {
			return fs
		}
	}
	return ""
}

func describeContent(cs *model.ContentSource) string {
	if cs.Snapshot != "" {
		return "snapshot " + cs.Snapshot
	}
	return "volume " + cs.Volume
}

// abandonCopy removes a volume whose copy a crash interrupted, thawing
// its source if the copy may have left it frozen. The caller holds the
// volume's lock.
func (d *Driver) abandonCopy(ctx context.Context, v *model.Volume) error {
	if cs := v.ContentSource; cs.Frozen && cs.Volume != "" {
		if err := d.thawSource(ctx, cs.Volume); err != nil {
			return fmt.Errorf("volume %s: thaw source volume %s: %w", v.ID, cs.Volume, err)
		}
	}
	klog.FromContext(ctx).Info("Removing a volume whose copy a crash interrupted", "volume", v.ID, "from", describeContent(v.ContentSource))
	if err := d.removeImage(v); err != nil {
		return err
	}
	return d.records.Delete(v.ID, journal.Durable)
}

// sourceVolume locks and reads a provisioned volume that is to be copied
// (the source of a snapshot or a clone). The returned func is never nil.
func (d *Driver) sourceVolume(id, op string) (*model.Volume, func(), error) {
	if model.ValidID(id) != nil {
		return nil, func() {}, fmt.Errorf("source volume %s: %w", id, errdefs.ErrNotFound)
	}
	v, unlock, err := d.records.Locked(id, op)
	if err != nil {
		return nil, unlock, err
	}
	if v.Creating {
		// A create that was never answered: no volume for the CO.
		return nil, unlock, fmt.Errorf("source volume %s: %w", id, errdefs.ErrNotFound)
	}
	if v.Kind != model.KindProvisioned {
		return nil, unlock, fmt.Errorf("volume %s is %s: only volumes this plugin provisioned can be copied: %w", id, v.Kind, errdefs.ErrInvalidArgument)
	}
	return v, unlock, nil
}

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
