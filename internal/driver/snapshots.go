package driver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// CreateSnapshot copies the image of a provisioned volume, as one point in
// time (see copyVolumeImage), to <state-dir>/images/snapshots/<name>.img.
// The record is written Creating before the copy and completed after it,
// so a crash in between leaves nothing that a later call or the
// reconciler does not remove. Idempotent by name.
func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	name, srcID := req.GetName(), req.GetSourceVolumeId()
	if err := requireField("name", name); err != nil {
		return nil, err
	}
	if err := model.ValidID(name); err != nil {
		return nil, invalid("name %q cannot name a node-local snapshot (1-128 of [A-Za-z0-9._-])", name)
	}
	if err := requireField("source_volume_id", srcID); err != nil {
		return nil, err
	}
	for k := range req.GetParameters() {
		if !strings.HasPrefix(k, source.ReservedPrefix) {
			return nil, invalid("unknown snapshot parameter %q (a VolumeSnapshotClass for this driver needs none)", k)
		}
	}
	if err := d.checkTopology(req.GetAccessibilityRequirements()); err != nil {
		return nil, err
	}
	unlock, err := d.records.TryLockSnapshot(name, "CreateSnapshot")
	if err != nil {
		return nil, err
	}
	defer unlock()
	snap, err := d.records.Snapshot(name)
	switch {
	case err == nil && !snap.Creating:
		if snap.SourceVolume != srcID {
			return nil, fmt.Errorf("snapshot %s exists of volume %s, not %s: %w", name, snap.SourceVolume, srcID, errdefs.ErrAlreadyExists)
		}
		return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(snap)}, nil
	case err == nil:
		// Interrupted before it was answered: undo, then start over.
		if err := d.undoSnapshot(ctx, snap); err != nil {
			return nil, err
		}
	case !errors.Is(err, errdefs.ErrNotFound):
		return nil, err
	}
	snap, err = d.takeSnapshot(ctx, name, srcID)
	if err != nil {
		return nil, err
	}
	return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(snap)}, nil
}

// takeSnapshot copies volume srcID's image as snapshot name, whose lock
// the caller holds and which has no record.
func (d *Driver) takeSnapshot(ctx context.Context, name, srcID string) (*model.Snapshot, error) {
	v, unlock, err := d.sourceVolume(srcID, "CreateSnapshot")
	defer unlock()
	if err != nil {
		return nil, err
	}
	sn, err := d.snapshotterOf(v)
	if err != nil {
		return nil, err
	}
	snap := &model.Snapshot{ID: name, SourceVolume: srcID, Image: sn.SnapshotImagePath(name),
		SizeBytes: v.CapacityBytes, FsType: v.FsType, Created: time.Now().UTC(), Creating: true}
	if v.Format != nil && v.Format.Done {
		f := *v.Format
		snap.Format = &f
	}
	if err := d.records.PutSnapshot(snap); err != nil {
		return nil, err
	}
	markFrozen := func() error {
		snap.Frozen = true
		return d.records.PutSnapshot(snap)
	}
	method, err := d.copyVolumeImage(ctx, v, snap.Image, v.CapacityBytes, true, markFrozen)
	if err != nil {
		// No record outlives a failed snapshot: the name stays free.
		err = fmt.Errorf("snapshot %s of volume %s: %w", name, srcID, err)
		if errors.Is(err, errMayBeFrozen) {
			// The record (Creating, Frozen) stays: whoever undoes it
			// (a retry, the reconciler) thaws the source first.
			return nil, err
		}
		return nil, errors.Join(err, sn.RemoveImage(snap.Image), d.records.DeleteSnapshot(name))
	}
	snap.Creating, snap.Frozen, snap.Method = false, false, string(method)
	if err := d.records.PutSnapshot(snap); err != nil {
		return nil, err
	}
	return snap, nil
}

// undoSnapshot removes what an interrupted or deleted snapshot left,
// thawing its source first if the copy may have left it frozen. The
// caller holds the snapshot's lock.
func (d *Driver) undoSnapshot(ctx context.Context, snap *model.Snapshot) error {
	if snap.Creating && snap.Frozen {
		if err := d.thawSource(ctx, snap.SourceVolume); err != nil {
			return fmt.Errorf("snapshot %s: thaw volume %s: %w", snap.ID, snap.SourceVolume, err)
		}
	}
	// The image first: a crash in between leaves a record a retried
	// delete finishes, never an image nobody knows about.
	if d.snapshotter == nil {
		return fmt.Errorf("snapshot %s: no volume source keeps snapshots: %w", snap.ID, errdefs.ErrFailedPrecondition)
	}
	if err := d.snapshotter.RemoveImage(snap.Image); err != nil {
		return err
	}
	return d.records.DeleteSnapshot(snap.ID)
}

func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if err := requireField("snapshot_id", req.GetSnapshotId()); err != nil {
		return nil, err
	}
	// Another node's snapshot is looked for here by its name all the
	// same, as before IDs named their node: a node never holds a name
	// another one took (the CO's names are unique), so nothing of another
	// node's is touched, and a delete sent astray answers as it did.
	id, _ := d.localSnapshot(req.GetSnapshotId())
	if model.ValidID(id) != nil {
		return &csi.DeleteSnapshotResponse{}, nil // such a snapshot cannot exist here
	}
	unlock, err := d.records.TryLockSnapshot(id, "DeleteSnapshot")
	if err != nil {
		return nil, err
	}
	defer unlock()
	snap, err := d.records.Snapshot(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	return &csi.DeleteSnapshotResponse{}, d.undoSnapshot(ctx, snap)
}

func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	var snaps []*model.Snapshot
	switch id, elsewhere := d.localSnapshot(req.GetSnapshotId()); {
	case req.GetSnapshotId() != "":
		if model.ValidID(id) != nil || elsewhere != "" {
			break // such a snapshot cannot exist here
		}
		snap, err := d.records.Snapshot(id)
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return nil, err
		}
		if err == nil {
			snaps = append(snaps, snap)
		}
	default:
		all, err := d.records.Snapshots()
		if err != nil {
			return nil, err
		}
		snaps = all
	}
	var ready []*model.Snapshot
	for _, s := range snaps {
		// One being taken has not been answered yet: not a snapshot yet.
		if !s.Creating && (req.GetSourceVolumeId() == "" || s.SourceVolume == req.GetSourceVolumeId()) {
			ready = append(ready, s)
		}
	}
	entries, next, err := page(ready, func(s *model.Snapshot) string { return s.ID }, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, s := range entries {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: d.csiSnapshot(s)})
	}
	return resp, nil
}

func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	if err := requireField("snapshot_id", req.GetSnapshotId()); err != nil {
		return nil, err
	}
	id, elsewhere := d.localSnapshot(req.GetSnapshotId())
	if model.ValidID(id) != nil || elsewhere != "" {
		return nil, fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	snap, err := d.records.Snapshot(id)
	if err != nil {
		return nil, err
	}
	if snap.Creating {
		return nil, fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	return &csi.GetSnapshotResponse{Snapshot: d.csiSnapshot(snap)}, nil
}

func (d *Driver) csiSnapshot(s *model.Snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:         d.snapshotRef(s.ID),
		SourceVolumeId:     s.SourceVolume,
		SizeBytes:          s.SizeBytes,
		CreationTime:       timestamppb.New(s.Created),
		ReadyToUse:         true,
		AccessibleTopology: []*csi.Topology{d.topology()},
	}
}

// reconcileSnapshots removes what interrupted snapshots left: records
// still Creating (thawing their source if it may be frozen), temp files
// of record writes and of copies, and images no record names. Each under
// the snapshot's lock; a busy snapshot is left for the next reconcile,
// since the request holding it finishes or undoes it itself.
func (d *Driver) reconcileSnapshots(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	recs, listErr := d.records.Snapshots()
	recTemps, err := d.records.SnapshotTempFiles()
	var images map[string]string
	var imgTemps map[string][]string
	var ierr error
	if d.snapshotter != nil {
		images, imgTemps, ierr = d.snapshotter.SnapshotImages()
	}
	if err := errors.Join(listErr, err, ierr); err != nil {
		logger.Error(err, "Some snapshot records or images could not be read; they are left as they are")
	}
	ids := map[string]bool{}
	for _, m := range []map[string][]string{recTemps, imgTemps} {
		for id := range m {
			ids[id] = true
		}
	}
	known := map[string]bool{}
	for _, s := range recs {
		known[s.ID] = true
		if s.Creating {
			ids[s.ID] = true
		}
	}
	for id := range images {
		if !known[id] && listErr == nil {
			ids[id] = true
		}
	}
	var errs []error
	for id := range ids {
		if err := d.reconcileSnapshot(ctx, id, append(recTemps[id], imgTemps[id]...)); err != nil {
			errs = append(errs, fmt.Errorf("snapshot %s: %w", id, err))
		}
	}
	return errors.Join(errs...)
}

// reconcileSnapshot undoes snapshot id if it was interrupted (or is an
// image without a record) and removes its temp files.
func (d *Driver) reconcileSnapshot(ctx context.Context, id string, temps []string) error {
	if model.ValidID(id) != nil {
		return nil
	}
	unlock, err := d.records.TryLockSnapshot(id, "reconcile")
	if err != nil {
		return nil
	}
	defer unlock()
	var errs []error
	for _, p := range temps {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	snap, err := d.records.Snapshot(id)
	switch {
	case errors.Is(err, errdefs.ErrNotFound) && d.snapshotter != nil:
		// An image without a record: no order of writes of ours leaves
		// one (the record is made before the image and removed after
		// it), but a lost record must not leak the space for good.
		errs = append(errs, d.snapshotter.RemoveImage(d.snapshotter.SnapshotImagePath(id)))
	case errors.Is(err, errdefs.ErrNotFound):
	case err != nil:
		errs = append(errs, err)
	case snap.Creating:
		klog.FromContext(ctx).Info("Removing a snapshot a crash interrupted", "snapshot", id, "volume", snap.SourceVolume)
		errs = append(errs, d.undoSnapshot(ctx, snap))
	}
	return errors.Join(errs...)
}
