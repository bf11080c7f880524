package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// DefaultRebootGrace is how long after a reboot the records of volumes
// that kubelet has not asked for again are kept (Options.RebootGrace):
// kubelet stages and publishes again, within a few minutes of its start,
// every volume of the pods still on the node. It is the time the
// reconciler gives a publish whose mount does not show (publishGrace).
const DefaultRebootGrace = publishGrace

// detectReboot compares the boot the journal recorded with the running
// one. In another boot every device, session, daemon, mount and consumer
// the records name is gone: each record's stage and publishes move to its
// Rebooted part, and its consumers are dropped, without asking the kernel
// about any of them (a loop device number of an ended boot may be another
// image's device now). Then the running boot is recorded. A crash in
// between marks again at the next start, which changes nothing twice. A
// state dir that recorded no boot (new, or written by a version that did
// not) is taken to be of this boot: its records are adopted as before.
// It runs in New, before any request can see the records.
func (d *Driver) detectReboot(logger klog.Logger) error {
	cur, err := d.opts.BootID()
	if err != nil {
		return err
	}
	boot := journal.OpenBoot(d.opts.StateDir)
	last, err := boot.Last()
	if err != nil {
		return err
	}
	if last != "" && last != cur {
		marked, err := d.markRebooted(logger, last)
		if err != nil {
			return err
		}
		d.rebootedFrom = last
		logger.Info(fmt.Sprintf("node rebooted since the last run (boot %s -> %s)", last, cur),
			"volumes", marked, "grace", d.opts.RebootGrace)
	}
	return boot.Record(cur)
}

// markRebooted moves the runtime part of every record to its Rebooted
// part and returns how many records had one.
func (d *Driver) markRebooted(logger klog.Logger, last string) (int, error) {
	now := time.Now().UTC()
	n := 0
	var errs []error
	for _, id := range d.records.IDs() {
		v, err := d.records.Get(id)
		if err != nil {
			errs = append(errs, err) // a record that does not read: the reconciler reports it
			continue
		}
		if v.Stage == nil && len(v.Publishes) == 0 && len(v.Consumers) == 0 && v.Rebooted == nil {
			continue
		}
		r := v.Rebooted
		if r == nil {
			r = &model.Rebooted{}
		}
		// A record of two ended boots keeps what the older one left on
		// disk until its source has removed it; kubelet gets the whole
		// grace again.
		r.Found = now
		if v.Stage != nil || r.Boot == "" {
			r.Boot, r.Stage = last, v.Stage
		}
		r.Publishes = append(r.Publishes, v.Publishes...)
		v.Rebooted, v.Stage, v.Publishes, v.Consumers = r, nil, nil, nil
		if err := d.records.Put(v, journal.Runtime); err != nil {
			return n, err
		}
		n++
	}
	if len(errs) > 0 {
		logger.Error(errors.Join(errs...), "Records that do not read were not marked as of an ended boot")
	}
	return n, nil
}

// forgetRebootedStage has v's source remove what the stage of an ended
// boot left on disk (source.Forgetter), once: the record keeps the stage
// until that succeeded. The caller writes v.
func (d *Driver) forgetRebootedStage(ctx context.Context, v *model.Volume) error {
	r := v.Rebooted
	if r == nil || r.Stage == nil {
		return nil
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return err
	}
	if f, ok := src.(source.Forgetter); ok {
		sv := viewOf(v)
		sv.Staging, sv.State = true, slices.Clone(r.Stage.Source)
		if err := f.Forget(ctx, sv); err != nil {
			return fmt.Errorf("volume %s: what its stage of an ended boot left: %w", v.ID, err)
		}
	}
	r.Stage = nil
	return nil
}

// reconcileRebooted handles a volume kubelet has not staged or published
// since the reboot (a stage clears Rebooted): kept as it is within the
// grace, dropped after it.
func (d *Driver) reconcileRebooted(ctx context.Context, v *model.Volume) error {
	if time.Since(v.Rebooted.Found) < d.opts.RebootGrace {
		return nil
	}
	klog.FromContext(ctx).Info("No one asked for the volume within the reboot grace; dropping what the reboot erased",
		"rebootedAt", v.Rebooted.Found, "kind", v.Kind)
	return d.dropRebooted(ctx, v)
}

// dropRebooted forgets what a reboot erased of v: what its stage left on
// disk, and its publishes (removing a target the plugin made and nothing
// mounts). What is on disk stays: a provisioned volume's image and record
// until DeleteVolume. An inline volume, which exists only while kubelet
// publishes it, is removed with its image; a static volume's record,
// which exists only while it is staged, is removed.
func (d *Driver) dropRebooted(ctx context.Context, v *model.Volume) error {
	if err := d.forgetRebootedStage(ctx, v); err != nil {
		return err
	}
	for _, p := range v.Rebooted.Publishes {
		if err := d.removeRebootedTarget(ctx, p); err != nil {
			return err
		}
	}
	v.Rebooted = nil
	if v.Kind == model.KindEphemeral && v.Stage == nil {
		return d.destroyEphemeral(ctx, v)
	}
	return d.saveOrForget(v)
}

// removeRebootedTargets removes, when kubelet stages v again, the targets
// the ended boot's publishes made: kubelet publishes again at those of the
// pods still there, and the plugin makes them again. A target that does
// not go is left to kubelet (it removes its pods' directories too).
func (d *Driver) removeRebootedTargets(ctx context.Context, v *model.Volume) {
	if v.Rebooted == nil {
		return
	}
	for _, p := range v.Rebooted.Publishes {
		if err := d.removeRebootedTarget(ctx, p); err != nil {
			klog.FromContext(ctx).Error(err, "Removing the target of a publish of an ended boot", "target", p.TargetPath)
		}
	}
}

// removeRebootedTarget removes the target of a publish of an ended boot
// if the plugin made it and nothing is mounted there.
func (d *Driver) removeRebootedTarget(ctx context.Context, p model.Publish) error {
	if !p.CreatedTarget || d.isMountPoint(ctx, p.TargetPath) {
		return nil
	}
	return d.node.RemoveTarget(ctx, p.TargetPath)
}

// unpublishRebooted answers kubelet's unpublish of a publish of an ended
// boot: nothing is mounted there since the reboot, so the target goes if
// the plugin made it, then the publish. An inline volume with no publish
// left, and not published again, is no one's: it is removed at once.
func (d *Driver) unpublishRebooted(ctx context.Context, v *model.Volume, target string) error {
	i := slices.IndexFunc(v.Rebooted.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	if err := d.removeRebootedTarget(ctx, v.Rebooted.Publishes[i]); err != nil {
		return err
	}
	v.Rebooted.Publishes = slices.Delete(v.Rebooted.Publishes, i, i+1)
	if v.Kind == model.KindEphemeral && len(v.Rebooted.Publishes) == 0 {
		return d.dropRebooted(ctx, v)
	}
	return d.records.Put(v, journal.Runtime)
}

// rebootedPublish reports whether v has a publish of an ended boot at
// target (kubelet has not staged v again since).
func rebootedPublish(v *model.Volume, target string) bool {
	return v != nil && v.Rebooted != nil &&
		slices.ContainsFunc(v.Rebooted.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
}

// AwaitingRestage counts the volumes whose devices and mounts a reboot
// erased and that kubelet has not staged or published again (nor given
// up): the mountplan_volumes_awaiting_restage gauge.
func (d *Driver) AwaitingRestage() int {
	vols, _ := d.records.List()
	n := 0
	for _, v := range vols {
		if v.Rebooted != nil {
			n++
		}
	}
	return n
}

// RebootedFrom is the boot this process found the node had left at its
// start, "" when it started in the boot it last ran in.
func (d *Driver) RebootedFrom() string { return d.rebootedFrom }
