package driver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
)

func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requirePath("target_path", req.GetTargetPath()); err != nil {
		return nil, err
	}
	c, err := checkCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	ephemeral := req.GetVolumeContext()[ctxEphemeral] == "true"
	if !ephemeral {
		if err := requirePath("staging_target_path", req.GetStagingTargetPath()); err != nil {
			return nil, err
		}
	}
	unlock, err := d.lock(id, "NodePublishVolume")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if ephemeral {
		return &csi.NodePublishVolumeResponse{}, d.publishEphemeral(ctx, req, c)
	}
	v, err := d.store.Get(id)
	if err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, d.publish(ctx, v, req.GetTargetPath(), c, req.GetReadonly())
}

// publish performs v's plan at target in the host namespace through the
// mounter, recording the publish before the mount so a crash cannot
// forget a mount it made.
func (d *Driver) publish(ctx context.Context, v *journal.Volume, target string, c capability, readOnly bool) error {
	if !v.Staged() {
		return fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if v.Stage.Block != c.block {
		return invalid("volume %s is staged for %s access", v.ID, accessName(v.Stage.Block))
	}
	readOnly = readOnly || c.readOnly
	if p := findPublish(v, target); p != nil {
		if p.ReadOnly != readOnly {
			return fmt.Errorf("volume %s is already published at %s with readonly=%t: %w", v.ID, target, p.ReadOnly, errdefs.ErrAlreadyExists)
		}
		if d.isMountPoint(target) {
			return nil
		}
	}
	mounts, err := d.planFor(v, source.PlanRequest{Block: c.block, ReadOnly: readOnly, MountFlags: c.mountFlags})
	if err != nil {
		return err
	}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p journal.Publish) bool { return p.TargetPath == target })
	v.Publishes = append(v.Publishes, journal.Publish{TargetPath: target, ReadOnly: readOnly, Mounts: mounts})
	if err := d.store.Put(v, journal.Runtime); err != nil {
		return err
	}
	if err := d.opts.Metrics.Step("mount", func() error {
		return d.opts.Mounter.Mount(ctx, mounts, plan.Consumer{MountPoint: target})
	}); err != nil {
		// A mounter that timed out or went away may still have mounted:
		// keep the record of a target that is mounted now, so the
		// unpublish kubelet sends next can remove it.
		if d.isMountPoint(target) {
			return err
		}
		v.Publishes = v.Publishes[:len(v.Publishes)-1]
		return errors.Join(err, d.store.Put(v, journal.Runtime))
	}
	return nil
}

// planFor asks v's source for a plan and checks it against the policy.
func (d *Driver) planFor(v *journal.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	mounts, err := src.Plan(v, req)
	if err != nil {
		return nil, err
	}
	if err := d.policy.Validate(mounts); err != nil {
		return nil, err
	}
	return mounts, nil
}

func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requirePath("target_path", target); err != nil {
		return nil, err
	}
	v, unlock, err := d.locked(id, "NodeUnpublishVolume")
	defer unlock()
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
	}
	if v == nil || findPublish(v, target) == nil {
		// Nothing of ours is published there (any more): done, unless
		// something else is mounted there, which is not ours to remove.
		if d.isMountPoint(target) {
			return nil, fmt.Errorf("%s holds a mount that is not a publish of volume %s: %w", target, id, errdefs.ErrNotFound)
		}
		return &csi.NodeUnpublishVolumeResponse{}, removeMountPoint(target)
	}
	return &csi.NodeUnpublishVolumeResponse{}, d.unpublish(ctx, v, target)
}

func (d *Driver) unpublish(ctx context.Context, v *journal.Volume, target string) error {
	p := findPublish(v, target)
	if err := d.opts.Mounter.Unmount(ctx, p.Mounts, plan.Consumer{MountPoint: target}); err != nil {
		return err
	}
	if err := removeMountPoint(target); err != nil {
		return err
	}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p journal.Publish) bool { return p.TargetPath == target })
	if v.Kind == journal.KindEphemeral {
		return d.destroyEphemeral(ctx, v)
	}
	return d.store.Put(v, journal.Runtime)
}

// isMountPoint reports whether p is a mount point. A path whose check fails
// (a dead FUSE mount answers ENOTCONN) counts as mounted: unmounting it is
// safer than believing it gone.
func (d *Driver) isMountPoint(p string) bool {
	mounted, err := mountinfo.Mounted(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	return mounted || err != nil
}

// blockDeviceSize reads the size of the block device at p (a published
// device-node bind), whatever kind of volume it belongs to.
func blockDeviceSize(p string) (int64, error) {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return 0, fmt.Errorf("open %s: %w", p, err)
	}
	defer unix.Close(fd)
	size, err := unix.IoctlGetUint64(fd, unix.BLKGETSIZE64)
	if err != nil {
		return 0, fmt.Errorf("BLKGETSIZE64 %s: %w", p, err)
	}
	return int64(size), nil
}

func accessName(block bool) string {
	if block {
		return "block"
	}
	return "mount"
}

// statsOf reports usage of a published volume.
func (d *Driver) statsOf(ctx context.Context, v *journal.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	if v.Stage != nil && v.Stage.Block {
		size, err := blockDeviceSize(path)
		if err != nil {
			return nil, err
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	var u fsutil.Usage
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	if st, ok := src.(source.Statter); ok {
		u, err = st.Stats(ctx, v, path)
	} else {
		u, err = fsutil.Stats(path)
	}
	if err != nil {
		return nil, err
	}
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: u.TotalBytes, Available: u.AvailableBytes, Used: u.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: u.TotalInodes, Available: u.FreeInodes, Used: u.UsedInodes},
	}}, nil
}

func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireField("volume_path", req.GetVolumePath()); err != nil {
		return nil, err
	}
	v, unlock, err := d.locked(id, "NodeExpandVolume")
	defer unlock()
	if err != nil {
		return nil, err
	}
	if !v.Staged() {
		return nil, fmt.Errorf("volume %s is not staged: %w", id, errdefs.ErrFailedPrecondition)
	}
	mountPath := ""
	if p := findPublish(v, req.GetVolumePath()); p != nil && !v.Stage.Block && d.isMountPoint(p.TargetPath) {
		mountPath = p.TargetPath
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	exp, ok := src.(source.Expander)
	if !ok {
		return nil, fmt.Errorf("%s volumes cannot be expanded: %w", v.Type, errdefs.ErrUnimplemented)
	}
	size, err := exp.Expand(ctx, v, mountPath, filepath.Join(d.opts.StateDir, "expand", id))
	if err != nil {
		return nil, err
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}
