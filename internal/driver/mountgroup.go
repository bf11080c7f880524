package driver

// VOLUME_MOUNT_GROUP: kubelet hands a pod's fsGroup to the driver
// (volume_capability.mount.volume_mount_group) instead of changing the
// ownership of the published directory itself. That matters in NRI mode,
// where kubelet would only reach the guard: the driver has the mounter give
// the volume's filesystem to the group, as kubelet would, at publish time.

import (
	"context"
	"fmt"
	"strconv"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// parseMountGroup reads volume_mount_group: a numeric group ID, or empty.
func parseMountGroup(s string) (gid uint32, set bool, err error) {
	if s == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false, invalid("volume_mount_group %q must be a numeric group ID", s)
	}
	return uint32(n), true, nil
}

// applyMountGroup gives v's filesystem to the capability's mount group
// through a private mount of its plan that the mounter makes and drops:
// the same whether kubelet's target holds the volume (published the
// classic way) or a guard (NRI mode).
func (d *Driver) applyMountGroup(ctx context.Context, v *model.Volume, c capability, readOnly bool) error {
	if _, owns := d.sources[v.Type].(source.FileOwner); !c.mountGroupSet || c.block || readOnly || owns {
		return nil
	}
	mounts, err := d.planFor(v, source.PlanRequest{MountFlags: c.mountFlags})
	if err != nil {
		return err
	}
	if err := d.node.ApplyGroup(ctx, mounts, c.mountGroup); err != nil {
		return fmt.Errorf("giving volume %s to group %d (fsGroup): %w", v.ID, c.mountGroup, err)
	}
	klog.FromContext(ctx).V(2).Info("Applied the mount group", "volume", v.ID, "gid", c.mountGroup)
	return nil
}
