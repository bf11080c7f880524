package driver

import (
	"context"
	"errors"
	"fmt"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Reattach performs v's recorded plans again at every consumer and publish,
// replacing what is mounted there. A source calls it after it restored the
// volume's backing mount (a restarted FUSE daemon), so running containers
// heal in place without any action from the pod.
func (d *Driver) Reattach(ctx context.Context, volumeID string) error {
	// Background work waits for a request instead of failing it with Aborted.
	unlock, err := d.vols.lock(ctx, volumeID, "reattach")
	if err != nil {
		return err
	}
	defer unlock()
	v, err := d.vols.Get(volumeID)
	if err != nil || !v.Staged() {
		return err
	}
	changed := d.dropDeadConsumers(ctx, v)
	var errs []error
	for _, c := range v.Consumers {
		if pendingContainer(c.Consumer) {
			continue // nothing mounted yet: its runtime will mount the new plan
		}
		errs = append(errs, d.replace(ctx, c.Mounts, plan.Consumer{PID: c.PID, MountPoint: c.MountPoint, Namespace: plan.Namespace{Inode: c.Namespace.Inode, ID: c.Namespace.ID}}))
	}
	for _, p := range v.Publishes {
		errs = append(errs, d.replace(ctx, p.Mounts, plan.Consumer{MountPoint: p.TargetPath}))
	}
	if changed {
		errs = append(errs, d.vols.Put(v, journal.Runtime))
	}
	return errors.Join(errs...)
}

// replace unmounts what a plan left at a consumer (a dead daemon's mount
// still sits there) and performs the plan again.
func (d *Driver) replace(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	if err := d.opts.Mounter.Unmount(ctx, mounts, c); err != nil {
		return fmt.Errorf("reattach at %s (pid %d): %w", c.MountPoint, c.PID, err)
	}
	if err := d.opts.Mounter.Mount(ctx, mounts, c); err != nil {
		return fmt.Errorf("reattach at %s (pid %d): %w", c.MountPoint, c.PID, err)
	}
	klog.FromContext(ctx).Info("Reattached", "mountPoint", c.MountPoint, "pid", c.PID)
	return nil
}
