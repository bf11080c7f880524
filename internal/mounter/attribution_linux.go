package mounter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/keylock"
	"github.com/mountplan/mountplan/internal/mountns"
	nriguard "github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The mounter acts only on what it can attribute (issue 33, findings F1 and
// F6). A compromised plugin names PIDs and paths; the mounter decides from
// its own records whether they are its business:
//
//   - Namespaces. It enters a consumer's mount namespace only when it can
//     tie it to a container: the container runtime told it about it (the
//     NRI hook, in the mounter's own process) or an admin named it (the
//     one-shot mount command). A host service's private namespace rooted at
//     the host's "/" (udevd, any unit with PrivateMounts), a containerised
//     kubelet or a privileged pod is neither, so a plan never reaches it.
//   - Mounts. It unmounts a mount only when it recorded making it there (the
//     namespace, the mount point, and the device and root inode of each
//     mount it attached), or when it is of a source the mounter itself set
//     up (a device it attached, a mount it made below the state dir: what
//     a FUSE heal or a re-armed NRI guard put in place of a recorded one).
//     runc's read-only /proc/sys, a container's masks, another pod's
//     secrets are none of these, and stay.
//
// The records live in the mounter's records dir, which the plugin cannot
// reach, and carry the boot they were made in: a reboot ends every
// namespace and mount they describe.

// Who vouched for a consumer namespace.
const (
	ByRuntime = "runtime" // the container runtime, through the NRI hook
	ByAdmin   = "admin"   // an admin's one-shot mount command
)

// maxAttributed bounds the namespace records: records of namespaces that
// are gone are dropped first when it is reached.
const maxAttributed = 8192

// nsRecord is a consumer namespace the mounter may enter.
type nsRecord struct {
	Namespace plan.Namespace `json:"namespace"`
	PID       int            `json:"pid"` // the process it was named by, for messages
	By        string         `json:"by"`
	Container string         `json:"container,omitempty"`
	Boot      string         `json:"boot"`
}

// mountPointRecord is a mount point where the mounter attached a plan.
type mountPointRecord struct {
	Namespace  plan.Namespace `json:"namespace"` // zero: the mounter's own (kubelet's publishes)
	MountPoint string         `json:"mountPoint"`
	Mounts     []madeMount    `json:"mounts"`
	Boot       string         `json:"boot"`
}

// madeMount is one mount the mounter attached: the plan's target, relative
// to the mount point, and the device and inode of the mount's root.
type madeMount struct {
	Target string `json:"target"`
	Dev    uint64 `json:"dev"`
	Ino    uint64 `json:"ino"`
}

// attribution keeps the records. A nil *attribution records nothing and
// vouches for everything: an Executor of an admin's one-shot command, or
// a test's.
type attribution struct {
	boot string
	// enforce: refuse what is not attributed (the mounter behind a socket,
	// Options.Attributed). Without, the records are kept all the same, for
	// the mounter that reads them.
	enforce bool
	nsDB    *journal.Records[nsRecord]
	mpDB    *journal.Records[mountPointRecord]
	locks   keylock.Locks // by mount point record
}

// openAttribution opens the records below dir. An observer (the one-shot
// mount command) writes them too, since the mounter beside it must later
// find the namespace an admin named; where no mounter ever made dir, there
// is no one to tell, and nil is returned.
func openAttribution(dir, boot string, observe, enforce bool) (*attribution, error) {
	if observe {
		if _, err := os.Stat(dir); err != nil {
			return nil, nil
		}
	}
	a := &attribution{boot: boot, enforce: enforce}
	var err error
	if a.nsDB, err = journal.OpenRecords[nsRecord](filepath.Join(dir, "namespaces"), false); err != nil {
		return nil, err
	}
	if a.mpDB, err = journal.OpenRecords[mountPointRecord](filepath.Join(dir, "mountpoints"), false); err != nil {
		return nil, err
	}
	return a, nil
}

// nsKey names a namespace in the records: by its never-reused ID where the
// kernel has one (Linux 6.8+), else by inode; "self" is the mounter's own
// (a consumer of PID 0), whatever namespace a restarted mounter gets.
func nsKey(ns plan.Namespace) string {
	switch {
	case ns == plan.Namespace{}:
		return "self"
	case ns.ID != 0:
		return "id-" + strconv.FormatUint(ns.ID, 10)
	}
	return "ino-" + strconv.FormatUint(ns.Inode, 10)
}

// mountPointKey names a mount point's record: its namespace's key first,
// so that a namespace's records are found by their names alone.
func mountPointKey(ns plan.Namespace, mountPoint string) string {
	return nsKey(ns) + "." + pathKey(mountPoint)
}

// Attribute records pid's mount namespace as one the mounter may enter, by
// the word of by (ByRuntime, ByAdmin), and returns its identity. Only the
// mounter's own process calls it (the NRI hook) and the admin's one-shot
// command; no socket call reaches it. The host's namespace, the mounter's
// own and PID 1 are never recorded.
func (n *Local) Attribute(ctx context.Context, pid int, by, container string) (plan.Namespace, error) {
	if pid <= 1 {
		return plan.Namespace{}, fmt.Errorf("pid %d cannot be a consumer: %w", pid, errdefs.ErrPermissionDenied)
	}
	ns, err := mountns.OpenPID(pid, plan.Namespace{})
	if err != nil {
		return plan.Namespace{}, err
	}
	defer ns.Close()
	if which, err := hostSide(ctx, ns); err != nil || which != "" {
		return plan.Namespace{}, errors.Join(err, fmt.Errorf("pid %d is in %s mount namespace: %w", pid, which, errdefs.ErrPermissionDenied))
	}
	id := ns.Identity()
	a := n.exec.attrib
	if a == nil {
		return id, nil
	}
	if err := a.attribute(ctx, nsRecord{Namespace: id, PID: pid, By: by, Container: container}); err != nil {
		return id, err
	}
	klog.FromContext(ctx).V(2).Info("Consumer namespace attributed", "pid", pid, "mntNS", id, "by", by, "container", container)
	return id, nil
}

// Forget drops what the mounter recorded of a container's namespace once
// the runtime says the container is gone (the NRI hook, at its stop or
// removal): the namespace record and the mount points in it. Records of a
// namespace nobody said is gone go with it at the next Prune.
func (n *Local) Forget(ctx context.Context, container string) error {
	if n.exec.attrib == nil || container == "" {
		return nil
	}
	return n.exec.attrib.forgetContainer(ctx, container)
}

// Prune drops the records of namespaces no process is left in (and of
// another boot). mountplan-sidecar serve calls it now and then: a
// container the hook never heard stop, an admin's consumer that exited.
func (n *Local) Prune(ctx context.Context) {
	if n.exec.attrib != nil {
		n.exec.attrib.prune(ctx)
	}
}

func (a *attribution) forgetContainer(ctx context.Context, container string) error {
	nss, err := a.nsDB.List()
	if err != nil {
		return err
	}
	var errs []error
	for key, rec := range nss {
		if rec.Container != container {
			continue
		}
		errs = append(errs, a.forgetMountPointsIn(rec.Namespace), a.nsDB.Delete(key))
		klog.FromContext(ctx).V(2).Info("Consumer namespace forgotten", "container", container, "mntNS", rec.Namespace)
	}
	return errors.Join(errs...)
}

// forgetMountPointsIn drops the mount point records of namespace ns, found
// by name (mountPointKey), none of them read.
func (a *attribution) forgetMountPointsIn(ns plan.Namespace) error {
	keys, err := a.mpDB.Keys()
	if err != nil {
		return err
	}
	var errs []error
	for _, key := range keys {
		if strings.HasPrefix(key, nsKey(ns)+".") {
			errs = append(errs, a.mpDB.Delete(key))
		}
	}
	return errors.Join(errs...)
}

func (a *attribution) attribute(ctx context.Context, rec nsRecord) error {
	rec.Boot = a.boot
	key := nsKey(rec.Namespace)
	if old, err := a.nsDB.Get(key); err == nil && old == rec {
		return nil
	}
	// Counted by name: every container start with a claim comes here.
	keys, err := a.nsDB.Keys()
	if err != nil {
		return err
	}
	if len(keys) >= maxAttributed {
		a.prune(ctx)
		if keys, err = a.nsDB.Keys(); err != nil {
			return err
		}
		if len(keys) >= maxAttributed {
			return fmt.Errorf("%d consumer namespaces are recorded, the most the mounter keeps: %w", len(keys), errdefs.ErrResourceExhausted)
		}
	}
	return a.nsDB.Put(key, rec)
}

// admit refuses a consumer whose namespace no one vouched for. PID 0 (the
// mounter's own namespace) is kept below the kubelet dir by admitConsumer.
func (a *attribution) admit(c plan.Consumer, ns *mountns.Namespace) error {
	if a == nil || !a.enforce || c.PID == 0 {
		return nil
	}
	return a.admitIdentity(c, ns.Identity())
}

func (a *attribution) admitIdentity(c plan.Consumer, id plan.Namespace) error {
	if a == nil || !a.enforce || c.PID == 0 {
		return nil
	}
	rec, err := a.nsDB.Get(nsKey(id))
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
	case torn(err):
		_ = a.nsDB.Delete(nsKey(id))
	case err != nil:
		return err
	case rec.Boot == a.boot && rec.Namespace.Matches(id):
		return nil
	}
	return fmt.Errorf("pid %d is in mount namespace %s, which neither the container runtime nor an admin named: "+
		"the mounter enters only namespaces it can attribute to a container: %w", c.PID, id, errdefs.ErrPermissionDenied)
}

// made returns what the mounter recorded attaching at c's mount point in
// namespace ns (zero for the mounter's own).
func (a *attribution) made(ns plan.Namespace, mountPoint string) (mountPointRecord, bool, error) {
	rec, err := a.mpDB.Get(mountPointKey(ns, mountPoint))
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return rec, false, nil
	case torn(err):
		return mountPointRecord{}, false, a.mpDB.Delete(mountPointKey(ns, mountPoint))
	case err != nil:
		return rec, false, err
	}
	return rec, rec.Boot == a.boot && rec.MountPoint == mountPoint, nil
}

// recordIntent records, before a Mount attaches anything, what it will
// attach, merged with what earlier calls attached there: a crash between
// the attach and a later write would otherwise leave a mount the mounter
// can no longer vouch for. undo puts the record back as it was, for a
// Mount that failed and rolled back.
func (a *attribution) recordIntent(ns plan.Namespace, mountPoint string, mounts []madeMount) (undo func() error, err error) {
	key := mountPointKey(ns, mountPoint)
	unlock, err := a.locks.Lock(context.Background(), key, "mount")
	if err != nil {
		return nil, err
	}
	defer unlock()
	old, had, err := a.made(ns, mountPoint)
	if err != nil {
		return nil, err
	}
	rec := mountPointRecord{Namespace: ns, MountPoint: mountPoint, Boot: a.boot}
	if had {
		rec.Mounts = append(rec.Mounts, old.Mounts...)
	}
	// A target recorded already keeps its entry: an idempotent repeat
	// attaches nothing there, and for a filesystem that gets a new
	// superblock per mount (tmpfs) the mount in place is the old one.
	// replace updates the entries of targets re-attached after all.
	for _, m := range mounts {
		if rec.find(m.Target) < 0 {
			rec.Mounts = append(rec.Mounts, m)
		}
	}
	if err := a.mpDB.Put(key, rec); err != nil {
		return nil, err
	}
	return func() error {
		if had {
			return a.mpDB.Put(key, old)
		}
		return a.mpDB.Delete(key)
	}, nil
}

// replace updates the entries of targets a Mount attached anew where an
// earlier one had recorded a mount that is no longer there.
func (a *attribution) replace(ns plan.Namespace, mountPoint string, mounts []madeMount) error {
	key := mountPointKey(ns, mountPoint)
	unlock, err := a.locks.Lock(context.Background(), key, "mount")
	if err != nil {
		return err
	}
	defer unlock()
	rec, had, err := a.made(ns, mountPoint)
	if err != nil || !had {
		return err
	}
	changed := false
	for _, m := range mounts {
		if i := rec.find(m.Target); i >= 0 && rec.Mounts[i] != m {
			rec.Mounts[i], changed = m, true
		}
	}
	if !changed {
		return nil
	}
	return a.mpDB.Put(key, rec)
}

// forget drops the record of a mount point whose plan was unmounted.
func (a *attribution) forget(ns plan.Namespace, mountPoint string) error {
	return a.mpDB.Delete(mountPointKey(ns, mountPoint))
}

func (r mountPointRecord) find(target string) int {
	for i, m := range r.Mounts {
		if m.Target == target {
			return i
		}
	}
	return -1
}

// prune drops the records of another boot and of namespaces no process
// is left in. A namespace that cannot be looked for (an unreadable /proc)
// keeps its records.
func (a *attribution) prune(ctx context.Context) {
	// One look through /proc per namespace, whatever number of records
	// name it.
	seen := map[plan.Namespace]bool{}
	gone := func(ns plan.Namespace) bool {
		if ns == (plan.Namespace{}) {
			return false
		}
		if g, ok := seen[ns]; ok {
			return g
		}
		_, ok, err := mountns.Find(ns)
		seen[ns] = err == nil && !ok
		return seen[ns]
	}
	var errs []error
	nss, err := a.nsDB.List()
	errs = append(errs, err)
	for key, rec := range nss {
		if rec.Boot != a.boot || gone(rec.Namespace) {
			errs = append(errs, a.nsDB.Delete(key))
		}
	}
	mps, err := a.mpDB.List()
	errs = append(errs, err)
	for key, rec := range mps {
		if rec.Boot != a.boot || gone(rec.Namespace) {
			errs = append(errs, a.mpDB.Delete(key))
		}
	}
	if err := errors.Join(errs...); err != nil {
		klog.FromContext(ctx).Error(err, "Some records of consumer namespaces and mount points could not be pruned")
	}
}

// torn reports whether a record could not be decoded: a write without
// fsync torn by a machine crash (the records describe a boot's namespaces
// and mounts, and need none), so of an ended boot, and as good as absent.
func torn(err error) bool { return errors.Is(err, journal.ErrCorrupt) }

// rootOf is the device and inode of the root of the mount on top at the
// open target t; ok is false when t is no mount's root or cannot be
// stat'ed (a dead FUSE mount).
func rootOf(t *os.File) (dev, ino uint64, ok bool) {
	st, err := statxOf(t, unix.STATX_INO, false)
	if err != nil || st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return 0, 0, false
	}
	return unix.Mkdev(st.Dev_major, st.Dev_minor), st.Ino, true
}

// recordedNS is the namespace a consumer's mounts are recorded under: the
// zero Namespace for the mounter's own (PID 0), whichever namespace the
// mounter runs in now (a restarted mounter's container has a new one,
// where kubelet's targets show the same mounts).
func recordedNS(c plan.Consumer, ns *mountns.Namespace) plan.Namespace {
	if c.PID == 0 {
		return plan.Namespace{}
	}
	return ns.Identity()
}

// recordMount records what a's Mount is about to attach at c's mount point
// (see recordIntent) and returns what to call with the attach's result:
// on failure the record is put back as it was, on success the entries of
// re-attached targets are brought up to date.
func (e *Executor) recordMount(ctx context.Context, c plan.Consumer, ns *mountns.Namespace, a *attacher) (done func(error) error, err error) {
	if e.attrib == nil {
		return func(err error) error { return err }, nil
	}
	id := recordedNS(c, ns)
	made := make([]madeMount, len(a.mounts))
	for i, m := range a.mounts {
		made[i] = madeMount{Target: m.Target, Dev: a.roots[i].dev, Ino: a.roots[i].ino}
	}
	undo, err := e.attrib.recordIntent(id, c.MountPoint, made)
	if err != nil {
		return nil, fmt.Errorf("record the mount point %s: %w", c.MountPoint, err)
	}
	return func(err error) error {
		if err != nil {
			return errors.Join(err, undo())
		}
		var attached []madeMount
		for i, m := range a.mounts {
			if slices.Contains(a.attached, targetPath(c.MountPoint, m.Target)) {
				attached = append(attached, made[i])
			}
		}
		if err := e.attrib.replace(id, c.MountPoint, attached); err != nil {
			// The mounts are in place; only a later Unmount of a re-attached
			// tmpfs may be refused for it.
			klog.FromContext(ctx).Error(err, "Could not update the record of a mount point", "mountPoint", c.MountPoint)
		}
		return nil
	}, nil
}

// mountOwner tells whether a plan's mount is of something the mounter set
// up itself: a device it attached, connected or logged in, or the root of
// a bindable mount it made below the state dir (a chain's layer, a FUSE
// daemon's mount, the NRI guard). A plain directory is not: anyone who can
// write the state dir can name one that looks like another mount's root.
type mountOwner interface {
	ownsMountOf(m plan.Mount) bool
}

func (n *Local) ownsMountOf(m plan.Mount) bool {
	if m.Type == plan.TypeBind && !plan.Within("/dev", m.Source) {
		if !plan.Within(n.opts.StateDir, m.Source) || m.Source == n.opts.StateDir {
			return false
		}
		f, err := n.state.Open(m.Source)
		if err != nil {
			return false
		}
		defer f.Close()
		rec, ok := n.records.madeMount(f)
		return ok && bindable(rec.Kind)
	}
	if m.Type == "tmpfs" || !filepath.IsAbs(m.Source) {
		return false
	}
	f, err := n.openDevice(m.Source)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// voucher decides, for one Unmount, which of the mounts found on top of
// the plan's targets the mounter may remove (see the top of this file).
type voucher struct {
	a          *attribution
	ns         plan.Namespace
	mountPoint string
	mounts     []plan.Mount
	rec        mountPointRecord
	had        bool
	owned      []bool
}

// voucherFor reads, before the consumer's namespace is entered, what the
// mounter recorded at c's mount point and which of the plan's sources it
// set up. Nil without records (nothing is refused then).
func (e *Executor) voucherFor(c plan.Consumer, ns *mountns.Namespace, mounts []plan.Mount) (*voucher, error) {
	if e.attrib == nil {
		return nil, nil
	}
	id := recordedNS(c, ns)
	rec, had, err := e.attrib.made(id, c.MountPoint)
	if err != nil {
		return nil, err
	}
	v := &voucher{a: e.attrib, ns: id, mountPoint: c.MountPoint, mounts: mounts, rec: rec, had: had, owned: make([]bool, len(mounts))}
	if o, ok := e.sources.(mountOwner); ok && e.attrib.enforce {
		for i, m := range mounts {
			v.owned[i] = o.ownsMountOf(m)
		}
	}
	return v, nil
}

// of returns the check for the mount found at mount i's target: recorded
// there with the same root, or of a source the mounter set up (what a FUSE
// heal or a re-armed guard put in place of a recorded mount). A tmpfs has
// no source to tell it by: only its record vouches for it. Nil when
// nothing is enforced.
func (v *voucher) of(i int) func(*os.File) bool {
	if v == nil || !v.a.enforce {
		return nil
	}
	m := v.mounts[i]
	if v.had && nriguard.IsSource(m.Source) {
		// Whatever guard is on top where the mounter bound one (isOurs saw
		// a guard there) is the mounter's: a restarted mounter serves a
		// new guard and re-arms the targets of the dead one on top of it.
		return func(*os.File) bool { return true }
	}
	return func(t *os.File) bool {
		if j := v.rec.find(m.Target); v.had && j >= 0 {
			if dev, ino, ok := rootOf(t); ok && dev == v.rec.Mounts[j].Dev && ino == v.rec.Mounts[j].Ino {
				return true
			}
		}
		return m.Type != "tmpfs" && v.owned[i]
	}
}

// forget drops the mount point's record once its plan is unmounted.
func (v *voucher) forget() error {
	if v == nil || !v.had {
		return nil
	}
	return v.a.forget(v.ns, v.mountPoint)
}
