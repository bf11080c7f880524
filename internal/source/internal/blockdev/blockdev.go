// Package blockdev holds what every block-device source (loop, nbd, iscsi)
// does the same way: make sure a staged device holds a filesystem, with the
// journal's format intent, and turn a device into a plan.
package blockdev

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// MountableTypes are the filesystems a plan may mount from a block device.
var MountableTypes = []string{"ext4", "xfs", "btrfs", "erofs", "squashfs"}

// Filesystem says how EnsureFilesystem treats a device.
type Filesystem struct {
	// What names the device's content in errors ("image /srv/a.img",
	// "export disk1 on 10.0.0.5:10809").
	What string
	// Mountable are the filesystems accepted as found; anything else is
	// refused rather than reformatted. Empty: MountableTypes.
	Mountable []string
	// Tools detects and formats, in the mounter.
	Tools mounter.Filesystems
	// Metrics times the format step (nil: not recorded).
	Metrics *metrics.Metrics
}

// EnsureFilesystem returns the filesystem on device, making one only when
// the device is blank or when a format of ours was interrupted. Before mkfs
// it records a pending format durably (req.Record), after it the format
// done: a format interrupted by a crash is redone from scratch instead of
// trusting a half-written superblock.
func EnsureFilesystem(ctx context.Context, v source.Volume, dev mounter.Device, req source.StageRequest, f Filesystem) (string, error) {
	if v.Format != nil && v.Format.Done {
		return v.Format.FsType, nil
	}
	mountable := f.Mountable
	if len(mountable) == 0 {
		mountable = MountableTypes
	}
	interrupted := v.Format != nil && !v.Format.Done
	if !interrupted {
		found, err := f.Tools.Detect(ctx, dev)
		if err != nil {
			return "", err
		}
		if found != "" {
			if !slices.Contains(mountable, found) {
				return "", fmt.Errorf("%s holds %q, which is not a mountable filesystem; it is left untouched: %w", f.What, found, errdefs.ErrFailedPrecondition)
			}
			// Recorded with the stage's own final write: finding a
			// filesystem changes nothing on disk, so no durable write.
			return found, req.Record.SetFormat(model.Format{FsType: found, Done: true}, false)
		}
	}
	if req.ReadOnly {
		return "", fmt.Errorf("%s holds no filesystem and the volume is read-only: %w", f.What, errdefs.ErrFailedPrecondition)
	}
	fsType := req.FsType
	if interrupted {
		fsType = v.Format.FsType
	}
	if err := req.Record.SetFormat(model.Format{FsType: fsType}, true); err != nil {
		return "", err
	}
	if err := f.Metrics.Step("format", func() error { return f.Tools.Format(ctx, dev, fsType) }); err != nil {
		return "", err
	}
	return fsType, req.Record.SetFormat(model.Format{FsType: fsType, Done: true}, true)
}

// Plan mounts device with fsType (mount access) or binds the device node
// (block access), nosuid,nodev and ro as asked, plus the request's mount
// flags.
func Plan(volumeID, device, fsType string, deviceReadOnly bool, req source.PlanRequest) ([]plan.Mount, error) {
	ro := req.ReadOnly || deviceReadOnly
	if req.Block {
		return []plan.Mount{{Type: plan.TypeBind, Source: device, Options: plan.Options([]string{"nosuid"}, ro)}}, nil
	}
	if fsType == "" {
		return nil, fmt.Errorf("volume %s was staged for block access: %w", volumeID, errdefs.ErrInvalidArgument)
	}
	opts := plan.Options([]string{"nosuid", "nodev"}, ro, req.MountFlags...)
	return []plan.Mount{{Type: fsType, Source: device, Options: opts}}, nil
}

// DeviceOf names the block device /dev/NAME by its number, read from
// sysfs (<sysDir>/class/block/NAME/dev): how a source hands the mounter a
// device it found (an NBD device, a SCSI disk).
func DeviceOf(sysDir, path string) (mounter.Device, error) {
	name, ok := strings.CutPrefix(path, "/dev/")
	if !ok || name == "" || strings.Contains(name, "/") {
		return mounter.Device{}, fmt.Errorf("%q is not a device node under /dev: %w", path, errdefs.ErrInvalidArgument)
	}
	b, err := os.ReadFile(filepath.Join(sysDir, "class", "block", name, "dev"))
	if err != nil {
		return mounter.Device{}, fmt.Errorf("device number of %s: %w", path, err)
	}
	d := mounter.Device{Path: path}
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &d.Major, &d.Minor); err != nil {
		return mounter.Device{}, fmt.Errorf("device number of %s: %q: %w", path, b, err)
	}
	return d, nil
}
