package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := d.kubelet.check("target_path", req.GetTargetPath()); err != nil {
		return nil, err
	}
	c, err := checkCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	if c.nri, err = parseNRI(req.GetVolumeContext()); err != nil {
		return nil, err
	}
	ephemeral := req.GetVolumeContext()[ctxEphemeral] == "true"
	if !ephemeral {
		if err := d.kubelet.check("staging_target_path", req.GetStagingTargetPath()); err != nil {
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

// checkStagingPath refuses a request whose staging path is not the one v
// was staged at: a publish or prepare may only name the volume kubelet
// staged there.
func checkStagingPath(v *model.Volume, stagingPath string) error {
	if v.Stage != nil && v.Stage.StagingPath != stagingPath {
		return invalid("volume %s is staged at %s, not at %s", v.ID, v.Stage.StagingPath, stagingPath)
	}
	return nil
}

// publish performs v's plan at target in the host namespace through the
// mounter. The plugin makes the target itself (beneath kubelet's
// directory, no symlink followed) and records that it did, so unpublish
// removes only what it made. The record is written before the mounter is
// asked, with the time it was asked: after a crash of either side the
// mount may still appear, and the record lets unpublish remove it.
func (d *Driver) publish(ctx context.Context, v *model.Volume, target string, c capability, readOnly bool) error {
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
		if d.isMountPoint(target) {
			return nil
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
	missing, err := d.kubelet.targetMissing(target)
	if err != nil {
		return err
	}
	rec := model.Publish{TargetPath: target, ReadOnly: readOnly, Mounts: mounts, CreatedTarget: missing || (prev != nil && prev.CreatedTarget), Asked: time.Now().UTC()}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	v.Publishes = append(v.Publishes, rec)
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	if _, err := d.kubelet.makeTarget(target, c.block); err != nil {
		v.Publishes = v.Publishes[:len(v.Publishes)-1]
		return errors.Join(err, d.records.Put(v, journal.Runtime))
	}
	err = d.opts.Metrics.Step("mount", func() error {
		return d.opts.Mounter.Mount(ctx, mounts, plan.Consumer{MountPoint: target})
	})
	if err == nil || d.isMountPoint(target) || mayStillMount(err) {
		// A mounter that timed out may still mount: keep the record, so
		// that the unpublish kubelet sends next (it treats such an error
		// as "maybe mounted") removes what is there.
		return err
	}
	v.Publishes = v.Publishes[:len(v.Publishes)-1]
	var rmErr error
	if rec.CreatedTarget {
		rmErr = d.kubelet.removeTarget(target)
	}
	return errors.Join(err, rmErr, d.records.Put(v, journal.Runtime))
}

// mayStillMount reports whether a failed Mount call may still have its
// effect: the call's time ran out while the mounter may still be at work.
// A mounter that refused, or went away (Unavailable: its process ended,
// or it never got the call), has done what the mount table shows.
func mayStillMount(err error) bool {
	switch errdefs.Code(err) {
	case codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// planFor asks v's source for a plan and checks it against the policy and
// the CO's mount flags against what each mount may take.
func (d *Driver) planFor(v *model.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	mounts, err := src.Plan(viewOf(v), req)
	if err != nil {
		return nil, err
	}
	if err := checkMountFlags(mounts, req.MountFlags); err != nil {
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
	if err := d.kubelet.check("target_path", target); err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodeUnpublishVolume")
	defer unlock()
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return nil, err
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
	if !d.isMountPoint(target) {
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
		if !d.isMountPoint(target) {
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

// unmountTarget has the mounter remove a publish's mounts. A mount that is
// busy for a moment (a NodeGetVolumeStats statfs holds it while it looks,
// without the volume's lock) is tried again a few times, for about 300ms
// in all, before the error stands.
func (d *Driver) unmountTarget(ctx context.Context, mounts []plan.Mount, target string) error {
	var err error
	for wait := 10 * time.Millisecond; ; wait *= 2 {
		err = d.opts.Mounter.Unmount(ctx, mounts, plan.Consumer{MountPoint: target})
		if errdefs.Code(err) != codes.FailedPrecondition || wait > 160*time.Millisecond {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}

// unpublish removes what the mounter put at target, then the target if
// the plugin made it, then the record.
func (d *Driver) unpublish(ctx context.Context, v *model.Volume, target string) error {
	p := findPublish(v, target)
	if err := d.unmountTarget(ctx, p.Mounts, target); err != nil {
		return err
	}
	if d.isMountPoint(target) {
		return fmt.Errorf("volume %s: a mount that is not its own sits on top at %s: %w", v.ID, target, errdefs.ErrFailedPrecondition)
	}
	if p.CreatedTarget {
		if err := d.kubelet.removeTarget(target); err != nil {
			return err
		}
	}
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	if v.Kind == model.KindEphemeral {
		return d.destroyEphemeral(ctx, v)
	}
	return d.records.Put(v, journal.Runtime)
}

// isMountPoint reports whether p is a mount point (mountns.IsMountPoint:
// a symlink at p is not followed). A path whose check fails (a dead FUSE
// mount on the way answers ENOTCONN) counts as mounted: unmounting it is
// safer than believing it gone.
func (d *Driver) isMountPoint(p string) bool {
	mounted, err := mountns.IsMountPoint(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	return mounted || err != nil
}

// blockDeviceSize reads the size of the block device at p (a device node
// under /dev, or a published device-node bind at kubelet's target),
// whatever kind of volume it belongs to, from sysfs: the plugin opens no
// device.
func blockDeviceSize(p string) (int64, error) {
	major, minor, err := sysfsDevice(p)
	if err != nil {
		return 0, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/size", major, minor))
	if err != nil {
		return 0, err
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", p, err)
	}
	return sectors * 512, nil
}

// sysfsDevice returns the number of the block device at p: the node's own
// when p is one this process can see (kubelet's target), else, for a node
// under /dev (the host's, which the plugin does not see), what sysfs says
// of the device of that name.
func sysfsDevice(p string) (major, minor uint32, err error) {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev)), nil //nolint:unconvert // Rdev is uint32 on some architectures
	}
	name, ok := strings.CutPrefix(p, "/dev/")
	if !ok || name == "" || strings.Contains(name, "/") {
		return 0, 0, fmt.Errorf("%s is no block device this plugin can see: %w", p, errdefs.ErrFailedPrecondition)
	}
	b, err := os.ReadFile(filepath.Join("/sys/class/block", name, "dev"))
	if err != nil {
		return 0, 0, fmt.Errorf("device number of %s: %w", p, err)
	}
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &major, &minor); err != nil {
		return 0, 0, fmt.Errorf("device number of %s: %q: %w", p, b, err)
	}
	return major, minor, nil
}

func accessName(block bool) string {
	if block {
		return "block"
	}
	return "mount"
}

// statsOf reports usage of a published volume.
func (d *Driver) statsOf(ctx context.Context, v *model.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
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
		u, err = st.Stats(ctx, viewOf(v), path)
	} else {
		u, err = fsutil.Stats(path)
	}
	if err != nil {
		return nil, err
	}
	return usageResponse(u), nil
}

func usageResponse(u fsutil.Usage) *csi.NodeGetVolumeStatsResponse {
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: u.TotalBytes, Available: u.AvailableBytes, Used: u.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: u.TotalInodes, Available: u.FreeInodes, Used: u.UsedInodes},
	}}
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
