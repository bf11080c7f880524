package driver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

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
		u, err = d.usageAt(ctx, path)
	}
	if err != nil {
		return nil, err
	}
	return usageResponse(u), nil
}

// usageAt measures the filesystem at path: in this process below the
// state dir (an NRI volume's chain or FUSE mount), else through the
// mounter, at a target in kubelet's directory, which the plugin does not
// see.
func (d *Driver) usageAt(ctx context.Context, path string) (fsutil.Usage, error) {
	if plan.Within(d.opts.StateDir, path) {
		return fsutil.Stats(path)
	}
	return d.node.StatTarget(ctx, path)
}

func usageResponse(u fsutil.Usage) *csi.NodeGetVolumeStatsResponse {
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: u.TotalBytes, Available: u.AvailableBytes, Used: u.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: u.TotalInodes, Available: u.FreeInodes, Used: u.UsedInodes},
	}}
}

// blockDeviceSize reads the size of the block device at p (a device node
// under /dev),
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
// when p is one this process can see, else, for a node under /dev (the
// host's, which the plugin does not see), what sysfs says of the device
// of that name.
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
