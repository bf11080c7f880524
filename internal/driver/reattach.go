package driver

import (
	"context"
	"errors"
	"fmt"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Reattach heals v after its source restored the volume's backing mount
// (a restarted FUSE daemon): first the mounter replaces, in place and in
// every mount namespace of the node, each mount of the dead connections
// with the new mount (HealFuse: the copies that containers got from a
// runtime's bind of kubelet's target, from NodePrepare or from the NRI
// path); then v's plan is performed again at every recorded consumer and
// publish, which changes nothing where the heal replaced the mount and
// mounts it again where it is missing. Running containers heal in place,
// with no action of theirs and no moment where their mount point shows
// the directory underneath. It returns the heal's result: Left lists the
// mounts of dead connections still in place.
func (d *Driver) Reattach(ctx context.Context, volumeID string, heal plan.Heal) (plan.HealResult, error) {
	// Background work waits for a request instead of failing it with Aborted.
	unlock, err := d.records.Lock(ctx, volumeID, "reattach")
	if err != nil {
		return plan.HealResult{}, err
	}
	defer unlock()
	v, err := d.records.Get(volumeID)
	if err != nil || !v.Staged() {
		return plan.HealResult{}, err
	}
	res, healed, err := d.healCopies(ctx, heal)
	if err != nil {
		return res, err
	}
	changed := d.dropDeadConsumers(ctx, v)
	redo := d.opts.Mounter.Mount
	if !healed {
		redo = d.replace // a mounter that cannot heal: unmount, then mount
	}
	var errs []error
	for _, c := range v.Consumers {
		if pendingContainer(c.Consumer) {
			continue // nothing mounted yet: its runtime will mount the new plan
		}
		errs = append(errs, reattachAt(ctx, redo, c.Mounts, plan.Consumer{PID: c.PID, MountPoint: c.MountPoint,
			Namespace: plan.Namespace{Inode: c.Namespace.Inode, ID: c.Namespace.ID}}))
	}
	for _, p := range v.Publishes {
		errs = append(errs, reattachAt(ctx, redo, p.Mounts, plan.Consumer{MountPoint: p.TargetPath}))
	}
	if changed {
		errs = append(errs, d.records.Put(v, journal.Runtime))
	}
	return res, errors.Join(errs...)
}

// healCopies has the mounter heal; healed is false when it cannot (a
// test's mounter that only mounts), and the caller falls back to
// replacing the recorded places only.
func (d *Driver) healCopies(ctx context.Context, heal plan.Heal) (res plan.HealResult, healed bool, err error) {
	h, ok := d.opts.Mounter.(mounter.Healer)
	if !ok {
		return res, false, nil
	}
	if len(heal.Dead) == 0 {
		return res, true, nil // no connection died: nothing to replace
	}
	res, err = h.HealFuse(ctx, heal)
	if err != nil {
		return res, false, fmt.Errorf("heal the mounts of dead FUSE connections %v: %w", heal.Dead, err)
	}
	if len(res.Healed) > 0 || len(res.Left) > 0 {
		klog.FromContext(ctx).Info("Healed the mounts of dead FUSE connections", "healed", len(res.Healed), "left", len(res.Left))
	}
	return res, true, nil
}

func reattachAt(ctx context.Context, do func(context.Context, []plan.Mount, plan.Consumer) error, mounts []plan.Mount, c plan.Consumer) error {
	if err := do(ctx, mounts, c); err != nil {
		return fmt.Errorf("reattach at %s (pid %d): %w", c.MountPoint, c.PID, err)
	}
	klog.FromContext(ctx).V(2).Info("Reattached", "mountPoint", c.MountPoint, "pid", c.PID)
	return nil
}

// replace unmounts what a plan left at a consumer (a dead daemon's mount
// still sits there) and performs the plan again.
func (d *Driver) replace(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	if err := d.opts.Mounter.Unmount(ctx, mounts, c); err != nil {
		return err
	}
	return d.opts.Mounter.Mount(ctx, mounts, c)
}
