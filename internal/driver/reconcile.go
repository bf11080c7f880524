package driver

import (
	"context"
	"errors"
	"io/fs"
	"maps"
	"os"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/internal/source"
)

// Reconcile compares every record with the kernel: it adopts staged devices
// (or re-attaches them when the kernel cleared them), undoes steps a crash
// interrupted, forgets publishes and consumers that are gone, and finishes
// or removes half-made inline volumes. The first call makes Probe ready.
func (d *Driver) Reconcile(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	start := time.Now()
	d.removeInterruptedWrites(ctx)
	if !d.ready.Load() && d.records.unreadable != nil {
		logger.Error(d.records.unreadable, "Some journal records could not be read; they are left as they are")
	}
	var errs []error
	for _, id := range d.records.IDs() {
		// Background work waits for the volume's lock, as Reattach does:
		// a volume skipped while busy (a FUSE sweep, a request) would go
		// unadopted until the next interval.
		unlock, err := d.records.Lock(ctx, id, "reconcile")
		if err != nil {
			return errors.Join(append(errs, err)...) // ctx ended
		}
		err = d.reconcileVolume(klog.NewContext(ctx, logger.WithValues("volume", id)), id)
		unlock()
		if errors.Is(err, errdefs.ErrNotFound) {
			continue // deleted since the IDs were taken
		}
		d.opts.Metrics.Reconciled(err)
		if err != nil {
			logger.Error(err, "Reconcile failed", "volume", id)
			errs = append(errs, err)
		}
	}
	if err := d.reconcileSnapshots(ctx); err != nil {
		logger.Error(err, "Reconciling snapshots failed")
		errs = append(errs, err)
	}
	if err := d.keepDevices(ctx, start); err != nil {
		logger.Error(err, "Telling the mounter which devices staged volumes still hold")
		errs = append(errs, err)
	}
	d.ready.Store(true)
	return errors.Join(errs...)
}

// keepDevices has each source whose devices the mounter keeps
// (source.Keeper) tell it which of them the volumes with a stage still
// hold, so that it lets go of the others it attached before the reconcile
// began.
func (d *Driver) keepDevices(ctx context.Context, start time.Time) error {
	vols, err := d.records.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, typ := range slices.Sorted(maps.Keys(d.sources)) {
		k, ok := d.sources[typ].(source.Keeper)
		if !ok {
			continue
		}
		var staged []source.Volume
		for _, v := range vols {
			if v.Type == typ && v.Stage != nil {
				staged = append(staged, viewOf(v))
			}
		}
		errs = append(errs, k.Keep(ctx, staged, start))
	}
	return errors.Join(errs...)
}

// removeInterruptedWrites removes the temp files that writes of records and
// images left when a crash interrupted them before their rename. Every such
// write runs under its volume's lock, so a temp file found while holding
// the lock belongs to no write in flight; a volume busy with a request is
// left for the next reconcile.
func (d *Driver) removeInterruptedWrites(ctx context.Context) {
	logger := klog.FromContext(ctx)
	records, err := d.records.TempFiles()
	images, ierr := d.tempImages()
	if err = errors.Join(err, ierr); err != nil {
		logger.Error(err, "Listing the temp files of interrupted writes")
	}
	temps := map[string][]string{}
	for _, m := range []map[string][]string{records, images} {
		for id, paths := range m {
			temps[id] = append(temps[id], paths...)
		}
	}
	for id, paths := range temps {
		unlock, err := d.records.TryLock(id, "reconcile")
		if err != nil {
			continue
		}
		for _, p := range paths {
			if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				logger.Error(err, "Removing the temp file of an interrupted write", "volume", id)
			}
		}
		unlock()
		logger.Info("Removed the temp files of writes a crash interrupted", "volume", id, "files", paths)
	}
}

// reconcileVolume reads id's record under its lock (the one decode of it
// that a reconcile makes) and compares it with the kernel.
func (d *Driver) reconcileVolume(ctx context.Context, id string) error {
	v, err := d.records.Get(id)
	if err != nil {
		return err
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return err
	}
	if v.Rebooted != nil && !v.Creating {
		// Its stage and publishes were of an ended boot: nothing of them
		// is compared with the kernel; kubelet stages it again, or not.
		return d.reconcileRebooted(ctx, v)
	}
	if v.Kind == model.KindEphemeral && (v.Creating || !v.Staged()) {
		return d.destroyEphemeral(ctx, v)
	}
	if v.Creating && v.ContentSource != nil {
		return d.abandonCopy(ctx, v)
	}
	if v.Stage == nil {
		return nil
	}
	if !v.Staged() {
		klog.FromContext(ctx).Info("Undoing a stage step a crash interrupted", "phase", v.Stage.Phase)
		if err := src.Unstage(ctx, viewOf(v)); err != nil {
			return err
		}
		v.Stage = nil
		return d.saveOrForget(v)
	}
	changed := d.dropDeadConsumers(ctx, v)
	n := len(v.Publishes)
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool {
		// An inline volume lives only as long as its publishes: while
		// kubelet keeps the pod's volume directory, it will publish again
		// (after a reboot) or unpublish, and the data must wait for it.
		return d.publishGone(ctx, p) && !(v.Kind == model.KindEphemeral && d.kubeletKeeps(ctx, p.TargetPath))
	})
	changed = changed || len(v.Publishes) != n
	if v.Kind == model.KindEphemeral && len(v.Publishes) == 0 {
		return d.destroyEphemeral(ctx, v)
	}
	if err := d.adopt(ctx, v, src); err != nil {
		return err
	}
	if changed {
		return d.records.Put(v, journal.Runtime)
	}
	return nil
}

// publishGrace is how long after the mounter was asked a publish whose
// target shows no mount is kept: a mounter cut off by a crash of the
// plugin may still be performing it (kubelet's calls time out after 2
// minutes). Once the mount shows, the record stays until unpublish.
const publishGrace = 10 * time.Minute

// publishGone reports whether a publish has left nothing behind: its
// target is not mounted (the kernel dropped it, or it was unmounted behind
// the plugin's back) and no mounter can still be at work on it. A younger
// publish stays, so that the unpublish kubelet sends removes a mount that
// appears late instead of finding no record of it.
func (d *Driver) publishGone(ctx context.Context, p model.Publish) bool {
	if p.NRI {
		return !d.nriPublished(ctx, &p) && time.Since(p.Asked) > publishGrace
	}
	return !d.isMountPoint(ctx, p.TargetPath) && time.Since(p.Asked) > publishGrace
}

// kubeletKeeps reports whether kubelet still has the directory it made
// for a publish's target (pods/<uid>/volumes/kubernetes.io~csi/<name>,
// with its vol_data.json): it removes it once the volume is torn down for
// good, and keeps it across reboots and restarts of anything. The
// mounter looks (the plugin does not see kubelet's directory); one that
// cannot answer keeps the data too.
func (d *Driver) kubeletKeeps(ctx context.Context, target string) bool {
	st, err := d.node.TargetState(ctx, target)
	return st.Parent || err != nil
}

// RunReconciler reconciles every interval until ctx ends, so consumers
// whose containers died are released without anyone calling Unprepare.
func (d *Driver) RunReconciler(ctx context.Context, interval time.Duration) {
	periodic.Every(ctx, interval, func(ctx context.Context) bool {
		_ = d.Reconcile(ctx)
		return true
	})
}
