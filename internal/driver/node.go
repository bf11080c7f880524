package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
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
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id := req.GetVolumeId()
	c, err := d.checkStaged(id, req.GetStagingTargetPath(), req.GetVolumeCapability())
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
			return d.adopt(ctx, v, src)
		}
		// An intent left by a crash: undo what may be half done, then stage anew.
		if err := src.Unstage(ctx, viewOf(v)); err != nil {
			return err
		}
	}
	v.Stage = &model.Stage{Phase: model.PhaseStaging, StagingPath: stagingPath, Block: c.block, ReadOnly: c.readOnly}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	// The recorded type first: CreateVolume and inline volumes sized the
	// image for it (xfs needs 300 MiB).
	fsType := cmp.Or(v.FsType, c.fsType, vctx[ctxFsType], vctx[paramCSIFsType], d.opts.Config.DefaultFsType)
	state, err := src.Stage(ctx, viewOf(v), source.StageRequest{Block: c.block, ReadOnly: c.readOnly, FsType: fsType, Secrets: secrets, Record: recorder{d.records, v}})
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
	return d.records.Put(v, journal.Runtime)
}

// adopt makes sure a staged volume's handles are live in this process.
func (d *Driver) adopt(ctx context.Context, v *model.Volume, src source.Source) error {
	state, err := src.Adopt(ctx, viewOf(v))
	if err != nil {
		return err
	}
	if string(state) != string(v.Stage.Source) {
		v.Stage.Source = state
		return d.records.Put(v, journal.Runtime)
	}
	return nil
}

// saveOrForget keeps the record of a volume that outlives its stage and
// drops the record of a static one, which exists only while staged.
func (d *Driver) saveOrForget(v *model.Volume) error {
	if v.Kind == model.KindStatic && v.Stage == nil {
		return d.records.Delete(v.ID, journal.Runtime)
	}
	return d.records.Put(v, journal.Runtime)
}

func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := d.kubelet.check("staging_target_path", req.GetStagingTargetPath()); err != nil {
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
	if pub == nil || !d.isMountPoint(pub.TargetPath) {
		return nil, fmt.Errorf("volume %s is not published at %s: %w", v.ID, req.GetVolumePath(), errdefs.ErrNotFound)
	}
	return d.statsOf(ctx, v, pub.TargetPath)
}

func findPublish(v *model.Volume, target string) *model.Publish {
	i := slices.IndexFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	if i < 0 {
		return nil
	}
	return &v.Publishes[i]
}

func describeConsumers(cs []model.Claim) string {
	parts := make([]string, 0, len(cs))
	for _, c := range cs {
		parts = append(parts, c.Consumer.String())
	}
	return strings.Join(parts, ", ")
}
