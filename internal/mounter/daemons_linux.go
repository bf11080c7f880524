package mounter

// FUSE daemons: the mounter makes each volume's directory below the state
// dir (<state-dir>/fuse/<volume>/, never following a symlink), mounts and
// fills its secrets' tmpfs, renders the daemon's command from its own copy
// of the admin's profile (internal/fuseprofile/policy), starts it with no_new_privs
// and the profile's capabilities only (internal/daemon), waits until its FUSE
// mount sits on mnt/ and answers, and records both: the mount, so that a
// plan may bind it (checkBindSource), and the daemon, so that it can be
// watched and stopped after the mounter restarts. The plugin only decides.
//
//	<state-dir>/fuse/<volume>/
//	  mnt/          the daemon's mount point; the plan binds it
//	  secrets/      a tmpfs (mode 0700) with one 0600 file per secret
//	  work/         private scratch space for the daemon ({workdir})
//	  daemon.log    the daemon's standard output and error (.1: the last one)

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/daemon/cgroup"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/keylock"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Bounds of what StartDaemon and StopDaemons take.
const (
	// maxSecret bounds one secret; the tmpfs holding them is 1 MiB.
	maxSecret  = 64 << 10
	maxSecrets = 16
	// maxKnown bounds the daemons a StopDaemons call may name.
	maxKnown = 16
	// Ready timeouts: the default, and the most a request may ask.
	defaultReadyTimeout = 30 * time.Second
	maxReadyTimeout     = 5 * time.Minute
	// stopGrace is how long a daemon stopped for good may take after
	// SIGTERM before its session gets SIGKILL.
	stopGrace = 5 * time.Second
	// logTailBytes is how much of a failed daemon's log an error quotes.
	logTailBytes = 2048
)

// maxDaemonVolumes bounds the volumes the mounter runs daemons for (a
// variable for tests).
var maxDaemonVolumes = 1024

// daemonsState is what the node keeps of the FUSE daemons it runs.
type daemonsState struct {
	db    *journal.Records[volumeDaemons] // nil: observing with no records yet
	locks keylock.Locks                   // one per volume: its start and stop do not overlap
	ctl   fusectl
	// realState is the state dir with symlinks resolved (the admin's path
	// may hold some): what the daemons are given and the mount table shows.
	realState string

	mu   sync.Mutex
	vols map[string]volumeDaemons
	// adopted counts the live daemons of an earlier mounter process
	// taken over at the start (adoptDaemons).
	adopted atomic.Int64
}

// volumeDaemons is the mounter's record of one volume's directory and
// daemons, under <records-dir>/daemons/<volume>.json.
type volumeDaemons struct {
	VolumeID string `json:"volumeID"`
	Boot     string `json:"boot"`
	// Secrets name the files of the secrets tmpfs, mounted at the first
	// start and kept until teardown; a restart reads them from there.
	Secrets []string `json:"secrets,omitempty"`
	// Daemons are those started and not known to be gone, oldest first.
	Daemons []daemonRecord `json:"daemons,omitempty"`
}

// daemonRecord is one daemon the mounter started.
type daemonRecord struct {
	daemon.Proc
	Generation int       `json:"generation"`
	Profile    string    `json:"profile"`
	Conn       uint64    `json:"conn,omitempty"`
	Started    time.Time `json:"started"`
	// Cgroup is the daemon's cgroup ("": it runs in the mounter's), and
	// OOMKills the cgroup's count of OOM kills when it started.
	Cgroup         string `json:"cgroup,omitempty"`
	OOMKills       uint64 `json:"oomKills,omitempty"`
	LimitsEnforced bool   `json:"limitsEnforced,omitempty"`
}

// fuseLayout is a volume's directory: below the state dir as given (how
// the mounter opens it, through n.state) and below the real state dir
// (what the daemon is given and the mount table shows).
type fuseLayout struct{ dir, real string }

func (l fuseLayout) mnt() string         { return filepath.Join(l.dir, "mnt") }
func (l fuseLayout) secrets() string     { return filepath.Join(l.dir, "secrets") }
func (l fuseLayout) work() string        { return filepath.Join(l.dir, "work") }
func (l fuseLayout) realMnt() string     { return filepath.Join(l.real, "mnt") }
func (l fuseLayout) realSecrets() string { return filepath.Join(l.real, "secrets") }
func (l fuseLayout) realWork() string    { return filepath.Join(l.real, "work") }
func (l fuseLayout) realLog() string     { return filepath.Join(l.real, "daemon.log") }

func (n *Local) fuseLayout(id string) (fuseLayout, error) {
	dir, err := n.volumeDir("fuse", id)
	if err != nil {
		return fuseLayout{}, err
	}
	return fuseLayout{dir: dir, real: filepath.Join(n.daemons.realState, "fuse", id)}, nil
}

// initDaemons takes back the records of the daemons after a restart:
// records of another boot are dropped, daemons that are gone forgotten;
// a volume's record stays (its directory and secrets do) for the next
// start. One that observes only reads them.
func (n *Local) initDaemons(ctx context.Context) error {
	if !n.opts.Observe {
		for _, p := range n.opts.Config.FuseProfiles {
			if p.SecretsReadableByRoot() {
				klog.FromContext(ctx).Info("WARNING: a FUSE profile takes secrets and runs its daemon as root: the plugin, root in its container, can read them; give the profile a runAs user other than root",
					"profile", p.Name)
			}
		}
	}
	d := &n.daemons
	d.vols = map[string]volumeDaemons{}
	real, err := filepath.EvalSymlinks(n.opts.StateDir)
	if err != nil {
		return fmt.Errorf("mounter: state dir: %w", err)
	}
	d.realState = real
	if real != n.opts.StateDir {
		n.profiles.Roots = append(n.profiles.Roots, real)
	}
	dir := filepath.Join(n.opts.RecordsDir, "daemons")
	if n.opts.Observe {
		if _, err := os.Stat(dir); err != nil {
			return nil
		}
	}
	if d.db, err = journal.OpenRecords[volumeDaemons](dir, false); err != nil {
		return err
	}
	recs, lerr := d.db.List()
	var errs []error
	for key, rec := range recs {
		if rec.Boot != n.records.boot || rec.VolumeID != key {
			if !n.opts.Observe {
				errs = append(errs, d.db.Delete(key))
			}
			continue
		}
		d.vols[key] = rec
	}
	if n.opts.Observe {
		return errors.Join(lerr, errors.Join(errs...))
	}
	// The cgroups first: a daemon that is not adopted is stopped through
	// its leaf too (a process that left its session is still in it). The
	// leaves of volumes with a live recorded daemon are kept meanwhile.
	n.initCgroups(ctx)
	errs = append(errs, n.adoptAll(ctx)...)
	return errors.Join(lerr, errors.Join(errs...))
}

// adoptStopBound bounds the stops of every daemon not adopted at a
// mounter's start together: the mounter's socket (and its liveness
// probe, ~60s) waits for them, however many stuck daemons a node has.
const adoptStopBound = 15 * time.Second

// adoptParallel is how many daemons not adopted are stopped at once.
const adoptParallel = 16

// adoptAll runs adoptDaemons for every recorded volume, stops the daemons
// not adopted in parallel within adoptStopBound, and records what is
// kept.
func (n *Local) adoptAll(ctx context.Context) []error {
	d := &n.daemons
	type stop struct {
		id string
		r  daemonRecord
		// leaf: no daemon of the volume is adopted, so every process in
		// its cgroup is killed too (a leaf is shared by the generations
		// of a volume: never killed under an adopted one).
		leaf bool
	}
	var stops []stop
	kept := map[string][]daemonRecord{}
	for id, rec := range d.vols {
		live := slices.DeleteFunc(slices.Clone(rec.Daemons), func(r daemonRecord) bool { return !r.Alive() })
		adopted, rest := n.adoptDaemons(ctx, id, rec.Daemons, live)
		kept[id] = adopted
		for _, r := range rest {
			stops = append(stops, stop{id: id, r: r, leaf: len(adopted) == 0})
		}
	}
	sctx, cancel := context.WithTimeout(ctx, adoptStopBound)
	defer cancel()
	failed := make([]bool, len(stops))
	sem := make(chan struct{}, adoptParallel)
	var wg sync.WaitGroup
	for i, s := range stops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			failed[i] = n.stopNotAdopted(sctx, s.id, s.r, s.leaf) != nil
		}()
	}
	wg.Wait()
	for i, s := range stops {
		if failed[i] {
			kept[s.id] = append(kept[s.id], s.r) // still recorded: a later stop finds it
		}
	}
	var errs []error
	for id, rec := range d.vols {
		k := kept[id]
		slices.SortFunc(k, func(a, b daemonRecord) int { return a.Generation - b.Generation })
		if len(k) != len(rec.Daemons) {
			rec.Daemons = k
			errs = append(errs, d.db.Put(id, rec))
			d.vols[id] = rec
		}
	}
	return errs
}

// stopNotAdopted stops r, a live daemon of volume id that is not adopted:
// its session, and with leaf every process in the volume's cgroup.
func (n *Local) stopNotAdopted(ctx context.Context, id string, r daemonRecord, leaf bool) error {
	log := klog.FromContext(ctx)
	err := daemon.Terminate(ctx, r.Proc, 0)
	if leaf && r.Cgroup != "" {
		err = errors.Join(err, n.stopCgroup(ctx, id, false))
	}
	if err != nil {
		log.Error(err, "Cannot stop a daemon that is not adopted", "volume", id, "pid", r.PID)
	}
	return err
}

// adoptDaemons takes over the live daemons of volume id that an earlier
// mounter process started (all of recorded; live those still running with
// the recorded start time): a daemon still serving the volume's mount
// (the FUSE mount on its mnt/ is the connection recorded for it, and the
// connection is in fusectl) is adopted: kept, counted, and watched again
// through a pidfd when the plugin asks (WaitDaemon), so that the plugin's
// heal replaces it if it dies later. Any other live one (an older
// generation, or one whose mount is gone or was never made: the earlier
// mounter stopped while starting it) is stopped now, like a dead one,
// so that the plugin replaces it (adoptAll stops them). It returns the
// daemons adopted and those to stop.
func (n *Local) adoptDaemons(ctx context.Context, id string, recorded, live []daemonRecord) (kept, stop []daemonRecord) {
	log := klog.FromContext(ctx)
	for _, r := range recorded {
		if !slices.Contains(live, r) {
			log.Info(fmt.Sprintf("FUSE daemon pid %d of volume %s is gone; the plugin replaces it", r.PID, id), "generation", r.Generation)
		}
	}
	for i, r := range live {
		why := n.notServing(id, r)
		if why == "" && i < len(live)-1 {
			why = "a newer daemon of the volume is recorded"
		}
		if why == "" {
			n.daemons.adopted.Add(1)
			log.Info(fmt.Sprintf("adopted FUSE daemon pid %d of volume %s", r.PID, id), "generation", r.Generation, "conn", r.Conn, "profile", r.Profile, "cgroup", r.Cgroup)
			kept = append(kept, r)
			continue
		}
		log.Info(fmt.Sprintf("FUSE daemon pid %d of volume %s is alive but not adopted; stopping it so that the plugin replaces it", r.PID, id), "reason", why)
		stop = append(stop, r)
	}
	return kept, stop
}

// notServing says why r does not serve volume id's mount ("": it does).
func (n *Local) notServing(id string, r daemonRecord) string {
	if r.Conn == 0 {
		return "it never served: the mounter that started it stopped before its mount answered"
	}
	l, err := n.fuseLayout(id)
	if err != nil {
		return err.Error()
	}
	info, err := mountns.FuseAt(l.realMnt())
	switch {
	case err != nil:
		return err.Error()
	case info == nil:
		return "no FUSE mount is on " + l.realMnt()
	case connOf(info) != r.Conn:
		return fmt.Sprintf("the FUSE mount on %s is connection %d, not its %d", l.realMnt(), connOf(info), r.Conn)
	}
	if _, err := n.daemons.ctl.waiting(r.Conn); err != nil {
		return fmt.Sprintf("FUSE connection %d: %v", r.Conn, err)
	}
	return ""
}

// Adopted counts the daemons this mounter process adopted at its start.
func (n *Local) Adopted() int64 { return n.daemons.adopted.Load() }

func (d *daemonsState) get(id string) (volumeDaemons, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rec, ok := d.vols[id]
	rec.Daemons = slices.Clone(rec.Daemons)
	return rec, ok
}

func (d *daemonsState) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.vols)
}

func (d *daemonsState) put(rec volumeDaemons) error {
	if err := d.db.Put(rec.VolumeID, rec); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.vols[rec.VolumeID] = rec
	return nil
}

func (d *daemonsState) drop(id string) error {
	d.mu.Lock()
	delete(d.vols, id)
	d.mu.Unlock()
	return d.db.Delete(id)
}

// find returns the record of p (same PID and start time) and its volume.
func (d *daemonsState) find(p daemon.Proc) (daemonRecord, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, v := range d.vols {
		for _, r := range v.Daemons {
			if r.Proc == p {
				return r, true
			}
		}
	}
	return daemonRecord{}, false
}

func (n *Local) daemonsUsable() error {
	if n.opts.Observe || n.daemons.db == nil {
		return fmt.Errorf("this mounter only reads the records of another: it runs no daemons: %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}

// StartDaemon starts one incarnation of a volume's daemon (see the file's
// comment). The first start of a volume (the mounter has no record of it)
// makes its directory and secrets; a later one (a restart, after
// StopDaemons without teardown) reuses them, and takes no secrets. On
// failure the daemon is stopped again (and a first start's directory
// removed), and the error quotes the end of the daemon's log with every
// secret redacted.
func (n *Local) StartDaemon(ctx context.Context, req DaemonRequest) (info DaemonInfo, err error) {
	if err := n.daemonsUsable(); err != nil {
		return info, err
	}
	l, err := n.fuseLayout(req.VolumeID)
	if err != nil {
		return info, err
	}
	if req.Generation < 1 {
		return info, fmt.Errorf("daemon generation %d: it counts from 1: %w", req.Generation, errdefs.ErrInvalidArgument)
	}
	if err := checkLabel(req.SELinuxContext); err != nil {
		return info, err
	}
	unlock, err := n.daemons.locks.Lock(ctx, req.VolumeID, "start-daemon")
	if err != nil {
		return info, err
	}
	defer unlock()
	rec, restart := n.daemons.get(req.VolumeID)
	if i := slices.IndexFunc(rec.Daemons, func(r daemonRecord) bool { return r.Alive() }); i >= 0 {
		return info, fmt.Errorf("volume %s has a running daemon %s; stop it first: %w", req.VolumeID, rec.Daemons[i].Proc, errdefs.ErrFailedPrecondition)
	}
	if !restart && n.daemons.count() >= maxDaemonVolumes {
		return info, fmt.Errorf("the mounter runs the daemons of %d volumes, its most: %w", maxDaemonVolumes, errdefs.ErrResourceExhausted)
	}
	names, red, err := n.daemonSecrets(l, req, rec, restart)
	if err != nil {
		return info, err
	}
	spec := daemon.Spec{Profile: req.Profile, Params: req.Params, ReadOnly: req.ReadOnly, MountGroup: req.MountGroup, Secrets: names,
		Paths: daemon.Paths{MountPoint: l.realMnt(), WorkDir: l.realWork(), SecretsDir: l.realSecrets(), Log: l.realLog()}}
	cmd, err := n.profiles.Command(spec) // everything checked before anything is made
	if err != nil {
		return info, err
	}
	prof, err := n.profiles.Profile(req.Profile)
	if err != nil {
		return info, err
	}
	if err := fuseDeviceOpenableBy(fuseDevice, prof, cmd.RunAs); err != nil {
		return info, err
	}
	timeout := req.ReadyTimeout
	if timeout <= 0 {
		timeout = defaultReadyTimeout
	}
	timeout = min(timeout, maxReadyTimeout)
	if !restart {
		rec = volumeDaemons{VolumeID: req.VolumeID, Boot: n.records.boot, Secrets: names}
		// Recorded first: a mounter that dies in what follows finds it.
		if err := n.daemons.put(rec); err != nil {
			return info, err
		}
	}
	defer func() {
		if err != nil {
			if serr := n.stopVolume(context.WithoutCancel(ctx), l, req.VolumeID, nil, !restart); serr != nil {
				klog.FromContext(ctx).Error(serr, "Undoing a failed daemon start left something behind", "volume", req.VolumeID)
			}
		}
	}()
	if err := n.makeVolumeDir(l, cmd.RunAs, restart, names, req.Secrets); err != nil {
		return info, err
	}
	leaf, err := n.daemonLeaf(req.VolumeID, prof)
	if err != nil {
		return info, err
	}
	cmd.Cgroup, cmd.CgroupV1 = leaf.Unified, leaf.V1
	proc, conn, err := n.runDaemon(ctx, l, &rec, req, prof, cmd, leaf, timeout)
	if err != nil {
		if tail := daemon.LogTail(l.realLog(), logTailBytes, red); tail != "" {
			err = fmt.Errorf("%w; the daemon's log ends with:\n%s", err, tail)
		}
		return info, err
	}
	return DaemonInfo{Proc: proc, Conn: conn, Command: cmd, MountPoint: l.realMnt(), BindSource: l.mnt()}, nil
}

// daemonSecrets returns the names of the volume's secrets and a redactor
// of their values: a first start's from the request, a restart's from the
// files the first one wrote, which must still be there (a reboot drops the
// tmpfs, and with it the mounter's record).
func (n *Local) daemonSecrets(l fuseLayout, req DaemonRequest, rec volumeDaemons, restart bool) ([]string, daemon.Redactor, error) {
	if restart {
		if len(req.Secrets) > 0 {
			return nil, nil, fmt.Errorf("volume %s: secrets are written at its first start only: %w", req.VolumeID, errdefs.ErrInvalidArgument)
		}
		if len(rec.Secrets) == 0 {
			return nil, nil, nil
		}
		vals, err := n.readSecrets(l, rec.Secrets)
		if err != nil {
			return nil, nil, fmt.Errorf("volume %s: its secrets are gone (%v); unstage and stage it again: %w", req.VolumeID, err, errdefs.ErrFailedPrecondition)
		}
		return rec.Secrets, daemon.RedactorOf(vals), nil
	}
	if len(req.Secrets) > maxSecrets {
		return nil, nil, fmt.Errorf("volume %s: %d secrets, more than %d: %w", req.VolumeID, len(req.Secrets), maxSecrets, errdefs.ErrInvalidArgument)
	}
	names := slices.Sorted(maps.Keys(req.Secrets))
	for _, k := range names {
		if len(req.Secrets[k]) > maxSecret {
			return nil, nil, fmt.Errorf("secret %q is larger than %d bytes: %w", k, maxSecret, errdefs.ErrInvalidArgument)
		}
	}
	if len(names) == 0 && req.Generation > 1 {
		// A restart the mounter has no record of (it rebooted): a profile
		// that needs secrets cannot have them again.
		if prof, err := n.profiles.Profile(req.Profile); err == nil && slices.ContainsFunc(prof.Secrets, func(s fuseprofile.Secret) bool { return !s.Optional }) {
			return nil, nil, fmt.Errorf("volume %s: its secrets are gone (the node restarted?); unstage and stage it again: %w", req.VolumeID, errdefs.ErrFailedPrecondition)
		}
	}
	return names, daemon.RedactorOf(slices.Collect(maps.Values(req.Secrets))), nil
}

// readSecrets reads the secret files of a volume's tmpfs, which must be
// the mount the mounter recorded.
func (n *Local) readSecrets(l fuseLayout, names []string) ([]string, error) {
	dir, err := n.state.Open(l.secrets())
	if err != nil {
		return nil, err
	}
	rec, ok := n.records.madeMount(dir)
	dir.Close()
	if !ok || rec.Kind != kindSecrets {
		return nil, fmt.Errorf("%s is not the tmpfs the mounter mounted", l.secrets())
	}
	var vals []string
	for _, name := range names {
		f, err := n.state.OpenFile(filepath.Join(l.secrets(), name), unix.O_RDONLY|unix.O_NOFOLLOW)
		if err != nil {
			return nil, err
		}
		b := make([]byte, maxSecret+1)
		k, err := f.Read(b)
		f.Close()
		if err != nil && k == 0 {
			return nil, err
		}
		vals = append(vals, string(b[:k]))
	}
	return vals, nil
}

// makeVolumeDir makes the volume's directory, mnt/ and work/ (owned by the
// daemon's user) below the state dir without following a symlink, and at
// a first start mounts the secrets' tmpfs with the secret files in it.
// Nothing may be mounted on mnt/ yet, nor on secrets/ at a first start.
func (n *Local) makeVolumeDir(l fuseLayout, runAs *daemon.User, restart bool, names []string, values map[string]string) error {
	// <state>/fuse and the volume's directory belong to the mounter's
	// user (see fsutil.MounterUID): the daemon is given their paths as
	// strings, and the plugin must not rename or plant anything there.
	// The volume's directory is traversable by a daemon of another user
	// than root, and listable by the mounter only.
	owner := &daemon.User{UID: fsutil.MounterUID, GID: fsutil.MounterGID}
	if err := n.makeDir(filepath.Dir(l.dir), 0o755, owner); err != nil {
		return err
	}
	if err := n.makeDir(l.dir, 0o711, owner); err != nil {
		return err
	}
	for _, d := range []string{l.mnt(), l.work()} {
		if err := n.makeDir(d, 0o700, runAs); err != nil {
			return err
		}
	}
	if err := n.notMounted(l.mnt()); err != nil {
		return err
	}
	if restart || len(names) == 0 {
		return nil
	}
	if err := n.makeDir(l.secrets(), 0o700, nil); err != nil {
		return err
	}
	if err := n.notMounted(l.secrets()); err != nil {
		return err
	}
	return n.mountSecrets(l, runAs, names, values)
}

// makeDir makes dir (and missing parents) below the state dir without
// following a symlink, and gives it mode and, when set, owner.
func (n *Local) makeDir(dir string, mode os.FileMode, owner *daemon.User) error {
	if _, err := n.state.MkdirAll(dir, false); err != nil {
		return err
	}
	f, err := n.state.OpenFile(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
	if err != nil {
		return err
	}
	defer f.Close()
	if owner != nil {
		if err := f.Chown(int(owner.UID), int(owner.GID)); err != nil {
			return err
		}
	}
	return f.Chmod(mode)
}

// notMounted refuses a directory of the volume that something is mounted
// on: a daemon the mounter lost track of; StopDaemons clears it.
func (n *Local) notMounted(dir string) error {
	f, err := n.state.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := mountOf(f); err == nil {
		return fmt.Errorf("%s is mounted on already; stop the volume's daemons first: %w", dir, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// mountSecrets builds a 1 MiB tmpfs (mode 0700, owned by the daemon's
// user, nosuid, nodev, noexec), writes each secret into a file of its own
// in it (mode 0600, O_EXCL|O_NOFOLLOW) while it is still detached, where
// nobody else can reach it, then attaches it at secrets/ (resolved without
// a symlink) and records it. Secrets never touch a disk, and unmounting
// the tmpfs removes them all at once.
func (n *Local) mountSecrets(l fuseLayout, runAs *daemon.User, names []string, values map[string]string) error {
	opts := []string{"nosuid", "nodev", "noexec", "size=1m", fmt.Sprintf("nr_inodes=%d", 2*maxSecrets), "mode=0700"}
	if runAs != nil {
		opts = append(opts, fmt.Sprintf("uid=%d", runAs.UID), fmt.Sprintf("gid=%d", runAs.GID))
	}
	mnt, err := mountns.BuildFrom(plan.Mount{Type: "tmpfs", Source: "mountplan-secrets", Options: opts}, nil)
	if err != nil {
		return fmt.Errorf("tmpfs for the secrets: %w", err)
	}
	defer mnt.Close()
	for _, name := range names {
		if err := writeSecret(mnt, name, values[name], runAs); err != nil {
			// The error of a write names the file, not what was written.
			return fmt.Errorf("secret file %s: %w", filepath.Join(l.secrets(), name), err)
		}
	}
	return n.attachBelowState(l.secrets(), mnt, kindSecrets)
}

func writeSecret(dir *os.File, name, value string, runAs *daemon.User) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return fmt.Errorf("a secret's name must be one path component: %w", errdefs.ErrInvalidArgument)
	}
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	_, err = f.WriteString(value)
	if err == nil && runAs != nil {
		err = f.Chown(int(runAs.UID), int(runAs.GID))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// runDaemon starts cmd (in fd mode after mounting for it), records it at
// once, waits until its FUSE mount sits on mnt/ and answers, and records
// the mount.
func (n *Local) runDaemon(ctx context.Context, l fuseLayout, rec *volumeDaemons, req DaemonRequest, prof *fuseprofile.Profile, cmd daemon.Command, leaf cgroup.Leaf, timeout time.Duration) (daemon.Proc, uint64, error) {
	w, err := newMountWatch()
	if err != nil {
		return daemon.Proc{}, 0, err
	}
	defer w.close()
	started := time.Now()
	proc, err := n.spawnDaemon(ctx, l, prof, req, cmd)
	if err != nil {
		return daemon.Proc{}, 0, fmt.Errorf("fuse daemon %s: %w", cmd.Path, err)
	}
	rec.Daemons = append(rec.Daemons, daemonRecord{Proc: proc, Generation: req.Generation, Profile: req.Profile, Started: started.UTC(),
		Cgroup: leaf.Path, OOMKills: leaf.OOMKills, LimitsEnforced: leaf.Enforced})
	if err := n.daemons.put(*rec); err != nil {
		_ = daemon.Terminate(context.WithoutCancel(ctx), proc, 0)
		return proc, 0, err
	}
	log := klog.FromContext(ctx)
	log.Info("Started daemon", "volume", req.VolumeID, "pid", proc.PID, "generation", req.Generation, "profile", req.Profile,
		"capabilities", cmd.Capabilities, "runAs", cmd.RunAs, "fdMode", prof.FdMount, "cgroup", leaf.Path, "limitsEnforced", leaf.Enforced)
	conn, err := n.waitReady(ctx, l, proc, timeout, w)
	if err != nil {
		return proc, conn, err
	}
	rec.Daemons[len(rec.Daemons)-1].Conn = conn
	if err := n.daemons.put(*rec); err != nil {
		return proc, conn, err
	}
	f, err := n.state.Open(l.mnt())
	if err != nil {
		return proc, conn, err
	}
	defer f.Close()
	if err := n.records.addMount(kindFuse, l.mnt(), f); err != nil {
		return proc, conn, err
	}
	log.Info("Daemon serving", "volume", req.VolumeID, "pid", proc.PID, "conn", conn, "after", time.Since(started).Round(time.Millisecond))
	return proc, conn, nil
}

// waitReady waits until a FUSE mount sits on top of mnt/, reading the
// mount table whenever it changes (mnt/ itself is not looked at before a
// FUSE mount is there), and then until the daemon answers a statfs
// through it: some daemons mount before they have reached their backend
// (sshfs mounts, then finds the host key refused, then exits). The
// daemon's exit, the timeout and ctx end the wait.
func (n *Local) waitReady(ctx context.Context, l fuseLayout, p daemon.Proc, timeout time.Duration, w *mountWatch) (uint64, error) {
	exited, stop := daemon.WatchExit(p)
	defer stop()
	deadline := time.Now().Add(timeout)
	for {
		info, err := mountns.FuseAt(l.realMnt())
		if err != nil {
			return 0, err
		}
		if info != nil {
			return connOf(info), n.waitServing(ctx, l, p, info, deadline, exited)
		}
		select {
		case <-exited:
			return 0, fmt.Errorf("fuse daemon %s exited before it mounted %s: %w", p, l.realMnt(), errdefs.ErrUnavailable)
		default:
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("waiting for the fuse daemon to mount %s: %w", l.realMnt(), ctx.Err())
		}
		left := time.Until(deadline)
		if left <= 0 {
			return 0, fmt.Errorf("fuse daemon %s did not mount %s within %v: %w", p, l.realMnt(), timeout, errdefs.ErrUnavailable)
		}
		w.wait(min(left, 50*time.Millisecond))
	}
}

// waitServing checks that the FUSE mount the table shows is the one on
// top of the mnt/ the mounter made (opened without a symlink), then runs a
// statfs through it in a goroutine and waits for its answer, the daemon's
// exit or the deadline. A statfs left behind returns when the caller's
// rollback aborts the connection.
func (n *Local) waitServing(ctx context.Context, l fuseLayout, p daemon.Proc, info *mountinfo.Info, deadline time.Time, exited <-chan struct{}) error {
	f, err := n.state.Open(l.mnt())
	if err != nil {
		return err
	}
	st, _, err := statMount(f)
	if err != nil {
		f.Close()
		return err
	}
	if int(st.Dev_major) != info.Major || int(st.Dev_minor) != info.Minor {
		f.Close()
		return fmt.Errorf("the FUSE mount at %s is not on the directory the mounter made: %w", l.realMnt(), errdefs.ErrPermissionDenied)
	}
	done := make(chan error, 1)
	go func() {
		defer f.Close()
		var sfs unix.Statfs_t
		done <- unix.Fstatfs(int(f.Fd()), &sfs)
	}()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("fuse daemon %s mounted %s but does not serve it: %w: %w", p, l.realMnt(), err, errdefs.ErrUnavailable)
		}
		return nil
	case <-exited:
		return fmt.Errorf("fuse daemon %s exited after it mounted %s: %w", p, l.realMnt(), errdefs.ErrUnavailable)
	case <-t.C:
		return fmt.Errorf("fuse daemon %s mounted %s but did not answer a statfs in time: %w", p, l.realMnt(), errdefs.ErrUnavailable)
	case <-ctx.Done():
		return fmt.Errorf("waiting for the fuse daemon to serve %s: %w", l.realMnt(), ctx.Err())
	}
}

// WaitDaemon returns nil once p, a daemon the mounter started, has exited
// (a pidfd: also a daemon of an earlier mounter process, which is not its
// child), or ctx's error. A process that is gone is no error; a live one
// the mounter did not start is ErrNotFound.
func (n *Local) WaitDaemon(ctx context.Context, p daemon.Proc) error {
	if !p.Alive() {
		return nil
	}
	if _, ok := n.daemons.find(p); !ok {
		return fmt.Errorf("%s is no daemon the mounter started: %w", p, errdefs.ErrNotFound)
	}
	if err := daemon.Wait(ctx, p); err != nil {
		return fmt.Errorf("waiting for daemon %s: %w", p, err)
	}
	return nil
}

// DaemonStatus says whether p, a daemon the mounter started, is alive and
// how many requests wait for it on its connection conn (fusectl's
// "waiting"; conn 0: not asked). A connection that is gone is ErrNotFound.
func (n *Local) DaemonStatus(_ context.Context, p daemon.Proc, conn uint64) (DaemonStatus, error) {
	rec, ok := n.daemons.find(p)
	if !ok {
		if !p.Alive() {
			return DaemonStatus{}, nil
		}
		return DaemonStatus{}, fmt.Errorf("%s is no daemon the mounter started: %w", p, errdefs.ErrNotFound)
	}
	st := DaemonStatus{Alive: p.Alive()}
	if !st.Alive {
		st.Reason, st.Detail = n.exitReason(rec)
	}
	if conn == 0 {
		return st, nil
	}
	if conn != rec.Conn {
		return st, fmt.Errorf("connection %d is not daemon %s's (%d): %w", conn, p, rec.Conn, errdefs.ErrInvalidArgument)
	}
	w, err := n.daemons.ctl.waiting(conn)
	if errors.Is(err, fs.ErrNotExist) {
		return st, fmt.Errorf("FUSE connection %d of daemon %s is gone: %w", conn, p, errdefs.ErrNotFound)
	}
	st.Waiting = w
	return st, err
}

// StopDaemons stops a volume's daemons: the FUSE connections mounted under
// its directory are aborted (callers blocked on them return, daemons
// reading them exit), the sessions of the daemons the mounter recorded
// for it and of those in known are ended, and whatever is left on mnt/ is
// lazily unmounted. With teardown (the volume is unstaged) daemons get
// SIGTERM and 5s before SIGKILL, the secrets are unmounted and the
// volume's files removed (never following a symlink), and the records
// forgotten; without (the caller replaces a daemon that failed) they get
// SIGKILL at once and the directory and secrets stay for the next start.
// A daemon in known is signalled only if it still is what it claims: the
// leader of its own session whose arguments name the volume's mount
// point (the daemon of an earlier mounter that kept no record).
// Idempotent; a volume the mounter knows nothing of is torn down from its
// directory alone.
func (n *Local) StopDaemons(ctx context.Context, volumeID string, known []daemon.Proc, teardown bool) error {
	if err := n.daemonsUsable(); err != nil {
		return err
	}
	l, err := n.fuseLayout(volumeID)
	if err != nil {
		return err
	}
	if len(known) > maxKnown {
		return fmt.Errorf("%d daemons named, more than %d: %w", len(known), maxKnown, errdefs.ErrInvalidArgument)
	}
	unlock, err := n.daemons.locks.Lock(ctx, volumeID, "stop-daemons")
	if err != nil {
		return err
	}
	defer unlock()
	return n.stopVolume(ctx, l, volumeID, known, teardown)
}

func (n *Local) stopVolume(ctx context.Context, l fuseLayout, id string, known []daemon.Proc, teardown bool) error {
	log := klog.FromContext(ctx).WithValues("volume", id)
	var errs []error
	mounts, err := mountns.MountsUnder(l.real)
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if mountns.IsFuse(m) {
			if err := n.daemons.ctl.abort(connOf(m)); err != nil {
				log.V(2).Info("Could not abort a FUSE connection", "conn", connOf(m), "err", err)
			}
		}
	}
	rec, recorded := n.daemons.get(id)
	var procs []daemon.Proc
	for _, r := range rec.Daemons {
		procs = append(procs, r.Proc)
	}
	for _, p := range known {
		if !slices.Contains(procs, p) && daemonOfVolume(p, l.realMnt()) {
			procs = append(procs, p)
		}
	}
	grace := time.Duration(0)
	if teardown {
		grace = stopGrace
	}
	var left []daemonRecord
	for _, p := range procs {
		if err := daemon.Terminate(ctx, p, grace); err != nil {
			errs = append(errs, err)
			if i := slices.IndexFunc(rec.Daemons, func(r daemonRecord) bool { return r.Proc == p }); i >= 0 {
				left = append(left, rec.Daemons[i])
			}
			continue
		}
		log.V(2).Info("Stopped daemon", "pid", p.PID)
	}
	// Whatever left the daemons' sessions is still in their cgroup.
	if len(errs) == 0 {
		errs = append(errs, n.stopCgroup(ctx, id, teardown))
	}
	// Also when a daemon would not die: its aborted connection and
	// detached mount still free the volume's directory.
	errs = append(errs, n.unmountVolumeDir(l.mnt()))
	if teardown {
		errs = append(errs, n.unmountVolumeDir(l.secrets()))
	}
	if err := errors.Join(errs...); err != nil {
		if recorded {
			rec.Daemons = left
			err = errors.Join(err, n.daemons.put(rec))
		}
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if !teardown {
		if recorded {
			rec.Daemons = nil
			return n.daemons.put(rec)
		}
		return nil
	}
	if err := n.removeVolumeDir(l); err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if recorded {
		if err := n.daemons.drop(id); err != nil {
			return err
		}
	}
	log.V(2).Info("FUSE volume torn down")
	return nil
}

// daemonOfVolume reports whether p is still the daemon a caller says it
// is: alive, the leader of its own session, with the volume's mount point
// as one of its arguments. A daemon in fd mode has /dev/fd/3 there
// instead and is never recognised here; it needs not be: its descriptor
// is the one holder of its connection, so the abort of the connections
// under the volume's directory (or the end of its mount) ends it.
func daemonOfVolume(p daemon.Proc, mnt string) bool {
	if !p.Alive() || p.PID == os.Getpid() {
		return false
	}
	st, ok := daemon.ReadStat(p.PID)
	if !ok || st.Session != p.PID {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
	if err != nil {
		return false
	}
	return slices.Contains(strings.Split(string(b), "\x00"), mnt)
}

// unmountVolumeDir unmounts the stack at dir, a directory of a volume,
// unless dir leads through a symlink (a plugin's, never followed): then no
// mount of the mounter's is there.
func (n *Local) unmountVolumeDir(dir string) error {
	f, err := n.state.Open(dir)
	if errors.Is(err, errdefs.ErrPermissionDenied) {
		return n.records.dropMount(dir)
	}
	if err == nil {
		f.Close()
	}
	return n.unmountBelowState(dir)
}

// removeVolumeDir removes the volume's files and directory, never
// recursively but for work/, the daemon's own scratch space, and
// secrets/, once unmounted: they are emptied through an os.Root opened on
// the directory found without a symlink, so that nothing left there leads
// outside it. A symlink in the volume's place is removed, not followed;
// an entry it does not know (nor made) makes it fail.
func (n *Local) removeVolumeDir(l fuseLayout) error {
	parent, err := n.state.Open(filepath.Dir(l.dir))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errdefs.ErrPermissionDenied) {
		return nil // no fuse/ of the mounter's: nothing of it to remove
	}
	if err != nil {
		return err
	}
	parent.Close()
	dir, err := n.state.OpenFile(l.dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if errors.Is(err, errdefs.ErrPermissionDenied) || errors.Is(err, unix.ENOTDIR) {
		return n.state.Remove(l.dir) // a symlink (or file) planted there
	}
	if err != nil {
		return err
	}
	root, err := os.OpenRoot(fmt.Sprintf("/proc/self/fd/%d", dir.Fd()))
	dir.Close()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range []string{"work", "secrets"} {
		if err := root.RemoveAll(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", filepath.Join(l.dir, name), err))
		}
	}
	root.Close()
	for _, name := range []string{"daemon.log", "daemon.log.1", "mnt"} {
		errs = append(errs, n.state.Remove(filepath.Join(l.dir, name)))
	}
	errs = append(errs, n.state.Remove(l.dir))
	return errors.Join(errs...)
}

// fuseDeviceOpenableBy refuses, before anything is made, a daemon that
// mounts by itself (a profile without fdMount) as a user whom the mode of
// /dev/fuse shuts out: Debian's is 0666 only where udev runs, and without
// it such a daemon can never mount; it would fail only after its ready
// timeout, with "failed to open /dev/fuse" in its log. The mode bits are
// what is read (an ACL or an LSM may say otherwise; the daemon's own
// failure then still tells). An fd-mode daemon never opens the device.
func fuseDeviceOpenableBy(dev string, prof *fuseprofile.Profile, runAs *daemon.User) error {
	if prof.FdMount || runAs == nil || runAs.UID == 0 {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return nil // the daemon's own failure says what is missing
	}
	perm := st.Mode & 0o777
	var ok bool
	switch {
	case st.Uid == runAs.UID:
		ok = perm&0o600 == 0o600
	case st.Gid == runAs.GID:
		ok = perm&0o060 == 0o060
	default:
		ok = perm&0o006 == 0o006
	}
	if ok {
		return nil
	}
	return fmt.Errorf("profile %s: its daemon mounts by itself as uid %d, and %s (mode %04o, owner %d:%d) does not let that user open it: "+
		"set fdMount: true in the profile (the mounter then opens the device and mounts), or run the daemon as root: %w",
		prof.Name, runAs.UID, dev, perm, st.Uid, st.Gid, errdefs.ErrFailedPrecondition)
}
