package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Volume context keys.
const (
	ctxType      = "type"
	ctxFsType    = "fsType"
	ctxEphemeral = source.ReservedPrefix + "ephemeral"
	ctxSize      = "size"
)

func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: d.opts.NodeID, AccessibleTopology: d.topology()}, nil
}

func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id := req.GetVolumeId()
	c, err := d.checkStaged(ctx, id, req.GetStagingTargetPath(), req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	unlock, err := d.records.TryLock(id, "NodeStageVolume")
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := d.volumeForStage(id, req.GetVolumeContext())
	if err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, d.stage(ctx, v, req.GetStagingTargetPath(), c, req.GetVolumeContext(), req.GetSecrets())
}

// volumeForStage finds the record of a provisioned volume, or has the
// source named by the context's type make one for a static volume.
func (d *Driver) volumeForStage(id string, vctx map[string]string) (*model.Volume, error) {
	v, err := d.records.Get(id)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return v, err
	}
	typ := cmp.Or(vctx[ctxType], d.opts.DefaultType)
	src, ok := d.sources[typ]
	if !ok {
		return nil, invalid("volume type %q is not supported (supported: %s)", typ, strings.Join(slices.Sorted(maps.Keys(d.sources)), ", "))
	}
	sv, err := src.NewVolume(id, withoutDriverAttributes(vctx))
	if err != nil {
		return nil, err
	}
	return recordOf(typ, sv), nil
}

// stage activates v, journaling the intent first. Repeating a completed
// stage with the same capability is a no-op.
func (d *Driver) stage(ctx context.Context, v *model.Volume, stagingPath string, c capability, vctx, secrets map[string]string) error {
	src, err := d.sourceOf(v)
	if err != nil {
		return err
	}
	if v.Stage != nil {
		if v.Staged() {
			if v.Stage.StagingPath != stagingPath {
				return fmt.Errorf("volume %s is already staged at %s: %w", v.ID, v.Stage.StagingPath, errdefs.ErrAlreadyExists)
			}
			if v.Stage.Block != c.block || v.Stage.ReadOnly != c.readOnly {
				return fmt.Errorf("volume %s is already staged with another access type or mode: %w", v.ID, errdefs.ErrAlreadyExists)
			}
			if v.Stage.SELinuxContext != c.seLinuxContext {
				return fmt.Errorf("volume %s is already staged with SELinux context %q, not %q: %w", v.ID, v.Stage.SELinuxContext, c.seLinuxContext, errdefs.ErrAlreadyExists)
			}
			err := d.adopt(ctx, v, src)
			if !errors.Is(err, source.ErrNeedsStage) {
				return err
			}
			klog.FromContext(ctx).Info("Staging the volume again: its source cannot recover it from its record", "volume", v.ID, "reason", err.Error())
		}
		// An intent left by a crash, or a stage its source cannot recover
		// alone: undo what may be left, then stage anew.
		if err := src.Unstage(ctx, viewOf(v)); err != nil {
			return err
		}
	}
	// Staged in an ended boot: what that stage left on disk goes first
	// (its devices went with the boot), then the volume is staged afresh.
	if err := d.forgetRebootedStage(ctx, v); err != nil {
		return err
	}
	v.Stage = &model.Stage{Phase: model.PhaseStaging, StagingPath: stagingPath, Block: c.block, ReadOnly: c.readOnly, SELinuxContext: c.seLinuxContext}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	// The recorded type first: CreateVolume and inline volumes sized the
	// image for it (xfs needs 300 MiB).
	fsType := cmp.Or(v.FsType, c.fsType, vctx[ctxFsType], vctx[paramCSIFsType], d.opts.Config.DefaultFsType)
	req := source.StageRequest{Block: c.block, ReadOnly: c.readOnly, FsType: fsType, Secrets: secrets, Record: recorder{d.records, v},
		SELinuxContext: c.seLinuxContext}
	if c.mountGroupSet {
		req.MountGroup = &c.mountGroup
	}
	state, err := src.Stage(ctx, viewOf(v), req)
	if err != nil {
		v.Stage = nil
		return errors.Join(err, d.saveOrForget(v))
	}
	v.Stage.Source, v.Stage.Phase = state, model.PhaseStaged
	if err := d.growCopiedFilesystem(ctx, v, src, c); err != nil {
		uerr := src.Unstage(ctx, viewOf(v))
		v.Stage = nil
		return errors.Join(err, uerr, d.saveOrForget(v))
	}
	// Kubelet asked for it again: what the reboot erased is history. It
	// publishes again where its pods still are, and the plugin makes those
	// targets afresh (so that unpublish removes them again).
	d.removeRebootedTargets(ctx, v)
	v.Rebooted = nil
	return d.records.Put(v, journal.Runtime)
}

// growCopiedFilesystem grows the filesystem of a volume copied into a
// bigger image, at its first stage with mount access: the record keeps
// GrowFilesystem until that succeeds (growing twice is harmless).
func (d *Driver) growCopiedFilesystem(ctx context.Context, v *model.Volume, src source.Source, c capability) error {
	if !v.GrowFilesystem || c.block || c.readOnly {
		return nil
	}
	g, ok := src.(source.Snapshotter)
	if !ok {
		return nil
	}
	if err := g.GrowUnmounted(ctx, viewOf(v)); err != nil {
		return fmt.Errorf("grow the filesystem copied into %s: %w", v.ID, err)
	}
	v.GrowFilesystem = false
	return d.records.Put(v, journal.Durable)
}

// saveOrForget keeps the record of a volume that outlives its stage and
// drops the record of a static one, which exists only while staged.
func (d *Driver) saveOrForget(v *model.Volume) error {
	if v.Kind == model.KindStatic && v.Stage == nil && v.Rebooted == nil {
		return d.records.Delete(v.ID, journal.Runtime)
	}
	return d.records.Put(v, journal.Runtime)
}

func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	// Unstage never opens the staging path (nor did the stage, which
	// walked it): its form is checked, a walk of it is not.
	if _, err := d.kubelet.rel("staging_target_path", req.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodeUnstageVolume")
	defer unlock()
	if errors.Is(err, errdefs.ErrNotFound) {
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if v.Stage == nil && v.Rebooted != nil {
		// Staged in an ended boot and given up by kubelet: nothing to
		// detach, what the stage left on disk goes now.
		return &csi.NodeUnstageVolumeResponse{}, d.dropRebooted(ctx, v)
	}
	return &csi.NodeUnstageVolumeResponse{}, d.unstage(ctx, v)
}

// unstage refuses while anyone still uses the volume, then deactivates it.
func (d *Driver) unstage(ctx context.Context, v *model.Volume) error {
	if v.Stage == nil {
		return nil
	}
	d.dropDeadConsumers(ctx, v)
	if len(v.Consumers) > 0 {
		return fmt.Errorf("volume %s is still prepared for %s: %w", v.ID, describeConsumers(v.Consumers), errdefs.ErrFailedPrecondition)
	}
	if len(v.Publishes) > 0 {
		targets := make([]string, 0, len(v.Publishes))
		for _, p := range v.Publishes {
			targets = append(targets, p.TargetPath)
		}
		return fmt.Errorf("volume %s is still published at %s: %w", v.ID, strings.Join(targets, ", "), errdefs.ErrFailedPrecondition)
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return err
	}
	v.Stage.Phase = model.PhaseUnstaging
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	if err := src.Unstage(ctx, viewOf(v)); err != nil {
		return err
	}
	v.Stage = nil
	klog.FromContext(ctx).V(2).Info("Unstaged")
	return d.saveOrForget(v)
}

func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	st, err := d.pathState(ctx, "target_path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	c, err := checkCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	c.target = &st
	if c.nri, err = parseNRI(req.GetVolumeContext()); err != nil {
		return nil, err
	}
	if c.pod, err = podOfContext(req.GetVolumeContext()); err != nil {
		return nil, err
	}
	ephemeral := req.GetVolumeContext()[ctxEphemeral] == "true"
	if !ephemeral {
		// Publish never opens the staging path: it must be the one the
		// stage recorded (checkStagingPath), which that stage resolved.
		// Its form is checked here; a walk of its directories is not.
		if _, err := d.kubelet.rel("staging_target_path", req.GetStagingTargetPath()); err != nil {
			return nil, err
		}
	}
	unlock, err := d.records.TryLock(id, "NodePublishVolume")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if ephemeral {
		return &csi.NodePublishVolumeResponse{}, d.publishEphemeral(ctx, req, c)
	}
	v, err := d.records.Get(id)
	if err != nil {
		return nil, err
	}
	if err := checkStagingPath(v, req.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, d.publish(ctx, v, req.GetTargetPath(), c, req.GetReadonly())
}

// publish performs v's plan at target in the host namespace through the
// mounter. The plugin has the mounter make the target (beneath kubelet's
// directory, no symlink followed) and records that it did, so unpublish
// removes only what it made. The record is written before the mounter is
// asked, with the time it was asked: after a crash of either side the
// mount may still appear, and the record lets unpublish remove it.
func (d *Driver) publish(ctx context.Context, v *model.Volume, target string, c capability, readOnly bool) error {
	if err := checkPublishes(v, target, c); err != nil {
		return err
	}
	if c.nri {
		return d.publishNRI(ctx, v, target, c, readOnly)
	}
	if !v.Staged() {
		return fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if v.Stage.Block != c.block {
		return invalid("volume %s is staged for %s access", v.ID, accessName(v.Stage.Block))
	}
	readOnly = readOnly || c.readOnly
	prev := findPublish(v, target)
	if prev != nil {
		if prev.ReadOnly != readOnly {
			return fmt.Errorf("volume %s is already published at %s with readonly=%t: %w", v.ID, target, prev.ReadOnly, errdefs.ErrAlreadyExists)
		}
		if st, err := d.targetState(ctx, c, target); err != nil || st.Mounted {
			return err
		}
	}
	mounts, err := d.planFor(v, source.PlanRequest{Block: c.block, ReadOnly: readOnly, MountFlags: c.mountFlags})
	if err != nil {
		return err
	}
	if err := d.applyMountGroup(ctx, v, c, readOnly); err != nil {
		return err
	}
	// Recorded before the target is made: a crash between making it and
	// recording that the plugin made it would leave a target that no
	// unpublish removes.
	st, err := d.targetState(ctx, c, target)
	if err != nil {
		return err
	}
	rec := model.Publish{TargetPath: target, ReadOnly: readOnly, Mounts: mounts, CreatedTarget: !st.Exists || (prev != nil && prev.CreatedTarget), Asked: time.Now().UTC(), SingleWriter: c.singleWriter, Pod: c.pod}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	v.Publishes = append(v.Publishes, rec)
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	if _, err := d.node.MakeTarget(ctx, target, c.block); err != nil {
		v.Publishes = v.Publishes[:len(v.Publishes)-1]
		return errors.Join(err, d.records.Put(v, journal.Runtime))
	}
	err = d.opts.Metrics.Step("mount", func() error {
		return d.opts.Mounter.Mount(ctx, mounts, plan.Consumer{MountPoint: target})
	})
	if err == nil || d.isMountPoint(ctx, target) || mayStillMount(err) {
		// A mounter that timed out may still mount: keep the record, so
		// that the unpublish kubelet sends next (it treats such an error
		// as "maybe mounted") removes what is there.
		return err
	}
	v.Publishes = v.Publishes[:len(v.Publishes)-1]
	var rmErr error
	if rec.CreatedTarget {
		rmErr = d.node.RemoveTarget(ctx, target)
	}
	return errors.Join(err, rmErr, d.records.Put(v, journal.Runtime))
}

// publishEphemeral creates, stages and publishes an inline volume in one
// go: kubelet sends no CreateVolume or NodeStageVolume for it. Any failure
// undoes every step, so a failed publish leaves no image behind.
func (d *Driver) publishEphemeral(ctx context.Context, req *csi.NodePublishVolumeRequest, c capability) (err error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	v, err := d.records.Get(id)
	if err == nil {
		if v.Kind != model.KindEphemeral {
			return fmt.Errorf("volume %s exists and is not an inline volume: %w", id, errdefs.ErrAlreadyExists)
		}
		if !v.Staged() {
			// Its image outlived a reboot (Rebooted): kubelet publishes
			// it again for the pod, with its data. A failure keeps it.
			if err := d.stage(ctx, v, d.opts.StateDir, c, nil, nil); err != nil {
				return err
			}
		}
		return d.publish(ctx, v, target, c, req.GetReadonly())
	}
	if !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	typ, prov, size, fsType, err := d.parseEphemeral(req.GetVolumeContext(), c)
	if err != nil {
		return err
	}
	if c.readOnly {
		return invalid("an inline volume starts empty, so a read-only access mode makes no sense")
	}
	if err := d.checkFits(id, size); err != nil {
		return err
	}
	v = &model.Volume{ID: id, Kind: model.KindEphemeral, Type: typ, FsType: fsType, CapacityBytes: size,
		Image: prov.ImagePath(model.KindEphemeral, id), Creating: true}
	if err := d.records.Put(v, journal.Durable); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.destroyEphemeral(ctx, v))
		}
	}()
	if _, err := prov.CreateImage(ctx, v.Image, size, ""); err != nil {
		return imageError(err)
	}
	v.Creating = false
	if err := d.stage(ctx, v, d.opts.StateDir, c, nil, nil); err != nil {
		return err
	}
	return d.publish(ctx, v, target, c, req.GetReadonly())
}

// destroyEphemeral tears down an inline volume: unstage, image, record.
func (d *Driver) destroyEphemeral(ctx context.Context, v *model.Volume) error {
	if len(v.Publishes) > 0 {
		return d.records.Put(v, journal.Runtime)
	}
	if err := d.unstage(ctx, v); err != nil {
		return err
	}
	if err := d.removeImage(v); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Inline volume removed", "volume", v.ID)
	return d.records.Delete(v.ID, journal.Durable)
}

func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if _, err := d.kubelet.rel("target_path", target); err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodeUnpublishVolume")
	defer unlock()
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	// A target this volume is recorded as published at was walked by that
	// publish; any other is walked now (the mounter looks), before
	// anything is asked about it.
	if v == nil || findPublish(v, target) == nil {
		if err := d.checkPath(ctx, "target_path", target); err != nil {
			return nil, err
		}
	}
	if rebootedPublish(v, target) && findPublish(v, target) == nil && !d.isMountPoint(ctx, target) {
		return &csi.NodeUnpublishVolumeResponse{}, d.unpublishRebooted(ctx, v, target)
	}
	if v == nil || findPublish(v, target) == nil {
		return &csi.NodeUnpublishVolumeResponse{}, d.unpublishUnrecorded(ctx, v, target)
	}
	return &csi.NodeUnpublishVolumeResponse{}, d.unpublish(ctx, v, target)
}

// unpublishUnrecorded answers an unpublish at a target the journal has no
// publish of. It touches nothing there, except a mount of this very
// volume (made by a mounter after the plugin had given the publish up):
// the mounter removes a mount only if it is the plan's. A mount that is
// not the volume's is not ours to remove.
func (d *Driver) unpublishUnrecorded(ctx context.Context, v *model.Volume, target string) error {
	if !d.isMountPoint(ctx, target) {
		return nil
	}
	if v != nil && v.Staged() {
		mounts, err := d.planFor(v, source.PlanRequest{Block: v.Stage.Block, ReadOnly: v.Stage.ReadOnly})
		if err != nil {
			return err
		}
		if err := d.unmountTarget(ctx, mounts, target); err != nil {
			return err
		}
		if !d.isMountPoint(ctx, target) {
			klog.FromContext(ctx).Info("Removed a mount of the volume that had no publish record", "target", target)
			return nil
		}
	}
	return fmt.Errorf("%s holds a mount that is not a publish of volume %s: %w", target, cmp.Or(volumeID(v), "(unknown)"), errdefs.ErrNotFound)
}

func volumeID(v *model.Volume) string {
	if v == nil {
		return ""
	}
	return v.ID
}

// unpublish removes what the mounter put at target, then the target if
// the plugin made it, then the record.
func (d *Driver) unpublish(ctx context.Context, v *model.Volume, target string) error {
	p := findPublish(v, target)
	if err := d.unmountTarget(ctx, p.Mounts, target); err != nil {
		return err
	}
	onTop := fmt.Errorf("volume %s: a mount that is not its own sits on top at %s: %w", v.ID, target, errdefs.ErrFailedPrecondition)
	if p.CreatedTarget {
		// The kernel refuses to remove a mount point (EBUSY:
		// FailedPrecondition), which tells what a look would, a round
		// trip to the mounter less.
		if err := d.node.RemoveTarget(ctx, target); errors.Is(err, errdefs.ErrFailedPrecondition) {
			return errors.Join(onTop, err)
		} else if err != nil {
			return err
		}
	} else if d.isMountPoint(ctx, target) {
		return onTop
	}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	if v.Kind == model.KindEphemeral {
		return d.destroyEphemeral(ctx, v)
	}
	return d.records.Put(v, journal.Runtime)
}

func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := requireVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := requireField("volume_path", req.GetVolumePath()); err != nil {
		return nil, err
	}
	v, err := d.records.Get(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	pub := findPublish(v, req.GetVolumePath())
	if pub != nil && pub.NRI {
		return d.statsNRI(ctx, v, pub)
	}
	if pub == nil || !d.isMountPoint(ctx, pub.TargetPath) {
		return nil, fmt.Errorf("volume %s is not published at %s: %w", v.ID, req.GetVolumePath(), errdefs.ErrNotFound)
	}
	// A block publish is measured by the device bound at the target: the
	// plugin does not see the target itself.
	if dev, ok := deviceBindSource(pub.Mounts); ok {
		return d.statsOf(ctx, v, dev)
	}
	return d.statsOf(ctx, v, pub.TargetPath)
}

func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireField("volume_path", req.GetVolumePath()); err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodeExpandVolume")
	defer unlock()
	if err != nil {
		return nil, err
	}
	if !v.Staged() {
		return nil, fmt.Errorf("volume %s is not staged: %w", id, errdefs.ErrFailedPrecondition)
	}
	required, limit := req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	if required < 0 || limit < 0 || (limit > 0 && required > limit) {
		return nil, fmt.Errorf("capacity range [%d, %d] is not a range: %w", required, limit, errdefs.ErrOutOfRange)
	}
	// volume_path is where the CO sees the volume: one of its publishes,
	// or its staging path.
	path := req.GetVolumePath()
	p := findPublish(v, path)
	if p == nil && path != v.Stage.StagingPath {
		return nil, fmt.Errorf("volume %s is not published or staged at %s: %w", id, path, errdefs.ErrNotFound)
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	exp, ok := src.(source.Expander)
	if !ok {
		return nil, fmt.Errorf("%s volumes cannot be expanded: %w", v.Type, errdefs.ErrUnimplemented)
	}
	size, err := exp.Expand(ctx, viewOf(v))
	if err != nil {
		return nil, err
	}
	// The filesystem now fills its device; the device's size is the
	// controller's business (ControllerExpandVolume grows the image).
	if size < required {
		return nil, fmt.Errorf("volume %s holds %d bytes, less than the %d asked for; expand it through ControllerExpandVolume first: %w", id, size, required, errdefs.ErrOutOfRange)
	}
	if limit > 0 && size > limit {
		return nil, fmt.Errorf("volume %s holds %d bytes, more than limit_bytes %d: %w", id, size, limit, errdefs.ErrOutOfRange)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// NodeGetVolumeHealth reports what the volume's source knows: a staged
// volume whose device or daemon is gone is INACCESSIBLE with a reason, one
// whose data is being lost DATA_LOSS. (CSI 1.13 removed VOLUME_CONDITION
// and NodeGetVolumeStats' volume_condition; this RPC replaces them.)
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if err := requireVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	v, err := d.records.Get(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	resp := &csi.NodeGetVolumeHealthResponse{VolumeHealth: &csi.VolumeHealth{VolumeId: v.ID}}
	if !v.Staged() {
		return resp, nil
	}
	if resp.VolumeHealth.HealthStatuses, err = d.sourceHealth(ctx, v); err != nil {
		return nil, err
	}
	return resp, nil
}
