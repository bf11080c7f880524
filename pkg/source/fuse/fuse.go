// Package fuse is the FUSE volume source: a daemon from an admin-defined
// profile (sshfs, rclone mount, squashfuse, ...) mounts the volume under
// the plugin's state dir, and the plan binds that mount into each
// consumer.
//
// Daemons outlive the plugin process: each runs in a session of its own,
// and the journal (plus daemon.json in the volume's directory) records its
// PID, start time and FUSE connection, so a restarted plugin adopts it
// instead of starting another. A supervisor per staged volume restarts a
// daemon that exited or stopped answering, then has the driver re-attach
// the new mount at every consumer and publish (Host.Reattach), so running
// containers heal in place. Nothing here ever stats a path that may be a
// dead FUSE mount without a deadline: health and stats answer from probes.
package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/fuseprofile"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/metrics"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
)

// Type is the volume_context type of this source.
const Type = "fuse"

// State is what the journal keeps of a staged FUSE volume. Daemon is the
// incarnation known when the record was last written; daemon.json in the
// volume's directory may hold a newer one (a restart by the supervisor),
// which Adopt folds back in.
type State struct {
	Profile string         `json:"profile"`
	Command daemon.Command `json:"command"`
	// MountPoint is where the daemon mounts (state dir symlinks resolved,
	// as the mount table shows it); BindSource is the same directory as
	// the plan names it.
	MountPoint   string        `json:"mountPoint"`
	BindSource   string        `json:"bindSource"`
	ReadOnly     bool          `json:"readOnly,omitempty"`
	Secrets      bool          `json:"secrets,omitempty"` // a secrets tmpfs is mounted
	ReadyTimeout time.Duration `json:"readyTimeout"`
	Daemon       Daemon        `json:"daemon"`
	// Stale are the connections of earlier daemons whose mounts may still
	// sit in some mount namespace (a container's copy): the supervisor has
	// them replaced with the current daemon's and forgets each once none
	// is left. The volume is not healthy while one is listed.
	Stale []uint64 `json:"staleConns,omitempty"`
}

// Options configure a Source.
type Options struct {
	// StateDir is the plugin's state dir; volumes live under StateDir/fuse.
	StateDir string
	// Profiles are the admin's FUSE profiles.
	Profiles []fuseprofile.Profile
	// Spawner starts daemons; nil means daemon.LocalSpawner (daemons in
	// the plugin's own cgroup).
	Spawner daemon.Spawner
	// Metrics times daemon starts and counts restarts (nil: not recorded).
	Metrics *metrics.Metrics
	// ProbeInterval is how often a supervisor checks that its daemon
	// answers (default 2s); ProbeTimeout is how long a statfs may take
	// before the daemon counts as hung (default 5s).
	ProbeInterval, ProbeTimeout time.Duration
}

// Source runs FUSE daemons. Create it with New; Run sweeps orphans and
// ends supervision when its context ends.
type Source struct {
	stateDir string
	profiles []fuseprofile.Profile
	spawner  daemon.Spawner
	metrics  *metrics.Metrics
	probe    time.Duration
	deadline time.Duration
	grace    time.Duration

	ctl fusectl
	log klog.Logger

	mu       sync.Mutex
	host     source.Host
	sups     map[string]*supervisor
	statting map[string]bool
	ctx      context.Context // parent of the supervisors
	stop     context.CancelFunc
	realDir  string
}

var (
	_ source.Source        = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
	_ source.Statter       = (*Source)(nil)
	_ source.HostUser      = (*Source)(nil)
)

// New returns a FUSE source. It starts nothing.
func New(o Options) (*Source, error) {
	dir, err := filepath.Abs(o.StateDir)
	if err != nil {
		return nil, err
	}
	s := &Source{
		stateDir: dir,
		profiles: o.Profiles,
		spawner:  o.Spawner,
		metrics:  o.Metrics,
		probe:    o.ProbeInterval,
		deadline: o.ProbeTimeout,
		grace:    5 * time.Second,
		log:      klog.Background().WithName("fuse"),
		sups:     map[string]*supervisor{},
		statting: map[string]bool{},
	}
	if s.spawner == nil {
		s.spawner = daemon.LocalSpawner{}
	}
	if s.probe <= 0 {
		s.probe = 2 * time.Second
	}
	if s.deadline <= 0 {
		s.deadline = 5 * time.Second
	}
	s.ctx, s.stop = context.WithCancel(context.Background())
	return s, nil
}

// SetHost receives the driver, which re-attaches healed mounts.
func (s *Source) SetHost(h source.Host) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.host = h
}

func (s *Source) getHost() source.Host {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.host
}

// root is <state-dir>/fuse with symlinks resolved, as the mount table
// shows it. The state dir exists once the driver has opened its journal.
func (s *Source) root() (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.realDir == "" {
		real, err := filepath.EvalSymlinks(s.stateDir)
		if err != nil {
			return "", fmt.Errorf("state dir: %w", err)
		}
		s.realDir = real
	}
	return filepath.Join(s.realDir, "fuse"), nil
}

func (s *Source) layout(id string) (layout, error) {
	if err := journal.ValidID(id); err != nil {
		return layout{}, err
	}
	root, err := s.root()
	if err != nil {
		return layout{}, err
	}
	return layout{dir: filepath.Join(root, id)}, nil
}

// NewVolume checks a static FUSE volume's context: a profile of the
// admin's, a source that profile accepts, and only options it allows.
func (s *Source) NewVolume(id string, vctx map[string]string) (source.Volume, error) {
	params, _, err := fuseprofile.VolumeParams(s.profiles, vctx)
	if err != nil {
		return source.Volume{}, fmt.Errorf("volume %s: %w", id, err)
	}
	return source.Volume{ID: id, Kind: journal.KindStatic, Parameters: params}, nil
}

// Stage starts the daemon on <state-dir>/fuse/<id>/mnt, waits until its
// FUSE mount appears, and starts supervising it.
func (s *Source) Stage(ctx context.Context, v source.Volume, req source.StageRequest) (_ json.RawMessage, err error) {
	if req.Block {
		return nil, invalid("fuse volumes have no block access")
	}
	// Checked again: the config may have changed since NewVolume.
	params, p, err := fuseprofile.VolumeParams(s.profiles, v.Parameters)
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	given, err := checkSecrets(p, req.Secrets)
	if err != nil {
		return nil, err
	}
	src, err := p.ResolveSource(params[fuseprofile.CtxSource])
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(p.Binary); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		return nil, fmt.Errorf("fuse profile %s: binary %s is not an executable file: %w", p.Name, p.Binary, errdefs.ErrFailedPrecondition)
	}
	l, err := s.layout(v.ID)
	if err != nil {
		return nil, err
	}
	if sup := s.takeSupervisor(v.ID); sup != nil {
		sup.halt() // of an earlier incarnation of this volume
	}
	if _, err := os.Lstat(l.dir); err == nil {
		// Left by a stage that died unrecorded: clear it first.
		if err := s.teardown(ctx, v.ID, Daemon{}); err != nil {
			return nil, err
		}
	}
	var started Daemon
	defer func() {
		if err != nil {
			if terr := s.teardown(context.WithoutCancel(ctx), v.ID, started); terr != nil {
				klog.FromContext(ctx).Error(terr, "Rollback of a failed FUSE stage left something behind", "dir", l.dir)
			}
		}
	}()
	st, red, err := s.makeDirAndCommand(l, p, params, src, req, given)
	if err != nil {
		return nil, err
	}
	st.BindSource = filepath.Join(s.stateDir, "fuse", v.ID, "mnt")
	klog.FromContext(ctx).V(4).Info("Starting FUSE daemon", "profile", p.Name, "path", st.Command.Path, "args", st.Command.Args)
	st.Daemon, err = s.start(ctx, l, st, 1, red, req.Record)
	if err != nil {
		return nil, err
	}
	started = st.Daemon
	raw, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	s.supervise(v.ID, st, l)
	klog.FromContext(ctx).V(2).Info("FUSE daemon serving", "pid", st.Daemon.PID, "conn", st.Daemon.Conn, "mountPoint", st.MountPoint)
	return raw, nil
}

// makeDirAndCommand makes the volume's directory and secrets and renders
// the daemon's command line.
func (s *Source) makeDirAndCommand(l layout, p *fuseprofile.Profile, params map[string]string, src string, req source.StageRequest, given map[string]bool) (State, redactor, error) {
	root := filepath.Dir(l.dir)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return State{}, nil, err
	}
	if err := os.Mkdir(l.dir, 0o700); err != nil {
		return State{}, nil, err
	}
	for _, d := range []string{l.mnt(), l.work()} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return State{}, nil, err
		}
		if p.RunAs != nil {
			if err := os.Chown(d, int(p.RunAs.UID), int(p.RunAs.GID)); err != nil {
				return State{}, nil, err
			}
		}
	}
	if p.RunAs != nil {
		// The daemon's user must reach its mount point and work dir.
		if err := os.Chmod(l.dir, 0o711); err != nil {
			return State{}, nil, err
		}
	}
	st := State{Profile: p.Name, MountPoint: l.mnt(), ReadOnly: req.ReadOnly, ReadyTimeout: p.ReadyTimeout.Duration}
	if st.ReadyTimeout == 0 {
		st.ReadyTimeout = 30 * time.Second
	}
	var values []string
	if len(given) > 0 {
		if err := mountSecrets(l.secrets(), p.RunAs); err != nil {
			return State{}, nil, err
		}
		st.Secrets = true
		if err := writeSecrets(l.secrets(), req.Secrets, given, p.RunAs); err != nil {
			return State{}, nil, err
		}
		for n := range given {
			values = append(values, req.Secrets[n])
		}
	}
	spec := daemon.Spec{Profile: p.Name, Params: params, ReadOnly: req.ReadOnly, Secrets: slices.Sorted(maps.Keys(given)),
		Paths: daemon.Paths{MountPoint: l.mnt(), WorkDir: l.work(), SecretsDir: l.secrets(), Log: l.log()}}
	cmd, err := p.Command(spec, src)
	if err != nil {
		return State{}, nil, err
	}
	st.Command = cmd
	return st, redactorOf(values), nil
}

// start spawns one incarnation of the daemon and waits until its FUSE
// mount appears at the mount point. The process is recorded (st with the
// new daemon, through rec) as soon as it exists, so a crash of the plugin
// while it waits cannot lose it; the caller records the daemon once
// ready. On failure the daemon is stopped again.
func (s *Source) start(ctx context.Context, l layout, st State, gen int, red redactor, rec source.Recorder) (d Daemon, err error) {
	w, err := newMountWatch()
	if err != nil {
		return Daemon{}, err
	}
	defer w.close()
	proc, err := s.spawner.Spawn(ctx, st.Command)
	if err != nil {
		return Daemon{}, fmt.Errorf("fuse daemon %s: %w", st.Command.Path, err)
	}
	d = Daemon{Generation: gen, Proc: proc, Started: time.Now().UTC()}
	defer func() {
		if err != nil {
			s.stopDaemon(context.WithoutCancel(ctx), l, d)
		}
	}()
	st.Daemon = d
	if err := source.SaveState(rec, st); err != nil {
		return d, err
	}
	conn, err := s.waitReady(ctx, l.mnt(), proc, st.ReadyTimeout, w)
	d.Conn = conn
	if err != nil {
		if tail := logTail(st.Command.Log, 2048, red); tail != "" {
			err = fmt.Errorf("%w; the daemon's log ends with:\n%s", err, tail)
		}
		return d, err
	}
	s.metrics.ObserveStep("daemon_start", time.Since(d.Started))
	return d, nil
}

// waitReady waits until a FUSE mount sits on top of mnt, reading the mount
// table whenever it changes (mnt itself is not looked at before a FUSE
// mount is there), and then until the daemon answers a statfs through it:
// some daemons mount before they have reached their backend (sshfs
// mounts, then finds the host key refused, then exits).
func (s *Source) waitReady(ctx context.Context, mnt string, p daemon.Proc, timeout time.Duration, w *mountWatch) (uint64, error) {
	exited, stopWatch := watchExit(p)
	defer stopWatch()
	deadline := time.Now().Add(timeout)
	for {
		info, err := fuseAt(mnt)
		if err != nil {
			return 0, err
		}
		if info != nil {
			return connOf(info), s.waitServing(ctx, mnt, p, deadline, exited)
		}
		select {
		case <-exited:
			return 0, fmt.Errorf("fuse daemon %s exited before it mounted %s: %w", p, mnt, errdefs.ErrUnavailable)
		default:
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("waiting for the fuse daemon to mount %s: %w", mnt, ctx.Err())
		}
		left := time.Until(deadline)
		if left <= 0 {
			return 0, fmt.Errorf("fuse daemon %s did not mount %s within %v: %w", p, mnt, timeout, errdefs.ErrUnavailable)
		}
		w.wait(-1, min(left, 50*time.Millisecond))
	}
}

// waitServing runs a statfs through the new mount in a goroutine and waits
// for its answer, the daemon's exit or the deadline. A statfs left behind
// returns when the caller's rollback aborts the connection.
func (s *Source) waitServing(ctx context.Context, mnt string, p daemon.Proc, deadline time.Time, exited <-chan struct{}) error {
	done := make(chan error, 1)
	go func() {
		_, err := fsutil.Stats(mnt)
		done <- err
	}()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("fuse daemon %s mounted %s but does not serve it: %w: %w", p, mnt, err, errdefs.ErrUnavailable)
		}
		return nil
	case <-exited:
		return fmt.Errorf("fuse daemon %s exited after it mounted %s: %w", p, mnt, errdefs.ErrUnavailable)
	case <-t.C:
		return fmt.Errorf("fuse daemon %s mounted %s but did not answer a statfs in time: %w", p, mnt, errdefs.ErrUnavailable)
	case <-ctx.Done():
		return fmt.Errorf("waiting for the fuse daemon to serve %s: %w", mnt, ctx.Err())
	}
}

// stopDaemon cuts a daemon's connection, stops its session and removes
// its mounts from the mount point (a dead FUSE mount stays in the table
// until unmounted).
func (s *Source) stopDaemon(ctx context.Context, l layout, d Daemon) {
	if d.Conn != 0 {
		if err := s.ctl.abort(d.Conn); err != nil {
			s.log.V(2).Info("Could not abort FUSE connection", "conn", d.Conn, "err", err)
		}
	}
	if err := terminate(ctx, d.Proc, s.grace); err != nil {
		s.log.Error(err, "Daemon did not stop")
	}
	if err := s.unmountUnder(l.mnt()); err != nil {
		s.log.Error(err, "Could not unmount a FUSE mount", "mountPoint", l.mnt())
	}
}

// unmountUnder aborts every FUSE connection mounted at or below dir and
// lazily unmounts everything there, newest first: a dead FUSE mount may be
// busy (a shell in it) and must still leave the table now.
func (s *Source) unmountUnder(dir string) error {
	infos, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	var errs []error
	for i := len(infos) - 1; i >= 0; i-- {
		if isFuse(infos[i]) {
			if err := s.ctl.abort(connOf(infos[i])); err != nil {
				errs = append(errs, err)
			}
		}
		errs = append(errs, mountns.Unmount(infos[i].Mountpoint, true))
	}
	return errors.Join(errs...)
}

// Plan binds the daemon's mount, nosuid and nodev always.
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if req.Block {
		return nil, invalid("fuse volume %s has no block access", v.ID)
	}
	if err := plan.CheckBindOptions(req.MountFlags); err != nil {
		return nil, fmt.Errorf("fuse volume %s: %w", v.ID, err)
	}
	opts := plan.Options([]string{"nosuid", "nodev"}, req.ReadOnly || st.ReadOnly, req.MountFlags...)
	return []plan.Mount{{Type: plan.TypeBind, Source: st.BindSource, Options: opts}}, nil
}

// Unstage stops supervising, stops the daemon (SIGTERM, then SIGKILL),
// unmounts what is left under the volume's directory, and removes its
// secrets and files. It works from the disk alone when the record has no
// state (a stage interrupted by a crash). Idempotent.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	var known Daemon
	if sup := s.takeSupervisor(v.ID); sup != nil {
		sup.halt()
		known = sup.daemon()
	}
	if st, err := source.DecodeState[State](v); err == nil && st.Daemon.Generation > known.Generation {
		known = st.Daemon
	}
	return s.teardown(ctx, v.ID, known)
}

// teardown removes everything of a volume's directory: the daemon known
// to the caller (and one a plugin of an earlier version recorded in
// daemon.json), mounts, secrets, files.
func (s *Source) teardown(ctx context.Context, id string, known Daemon) error {
	l, err := s.layout(id)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(l.dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	recorded, err := l.readLegacyDaemon()
	if err != nil {
		s.log.Error(err, "Unreadable daemon record; cleaning up from the mount table", "volume", id)
	}
	var errs []error
	for _, d := range []Daemon{known, recorded} {
		if d.PID > 0 {
			errs = append(errs, terminate(ctx, d.Proc, s.grace))
		}
	}
	// Also when a daemon would not die: aborting its connection and
	// detaching its mount still frees the volume's directory.
	errs = append(errs, s.unmountUnder(l.dir))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if err := l.removeFiles(); err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("FUSE volume torn down", "volume", id)
	return nil
}

// Adopt takes a staged volume's daemon under supervision after a plugin
// restart. A daemon that is alive, with its mount in place, is kept (same
// PID); one that is gone is restarted by the supervisor, which then
// re-attaches the consumers. It returns the state with the newest daemon.
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if sup := s.supervisorOf(v.ID); sup != nil {
		return json.Marshal(sup.state())
	}
	l, err := s.layout(v.ID)
	if err != nil {
		return nil, err
	}
	if d, err := l.readLegacyDaemon(); err == nil && d.Generation > st.Daemon.Generation {
		st.Daemon = d
	}
	if _, err := os.Lstat(l.dir); err != nil {
		return nil, fmt.Errorf("volume %s: its directory %s is gone: %w", v.ID, l.dir, errdefs.ErrFailedPrecondition)
	}
	if st.Daemon.Alive() {
		klog.FromContext(ctx).Info("Adopting FUSE daemon", "pid", st.Daemon.PID, "conn", st.Daemon.Conn)
	} else {
		klog.FromContext(ctx).Info("FUSE daemon gone; the supervisor restarts it", "pid", st.Daemon.PID)
	}
	s.supervise(v.ID, st, l)
	return json.Marshal(st)
}

// Health answers from the supervisor's view and the process table; it
// never touches the mount.
func (s *Source) Health(_ context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	if sup := s.supervisorOf(v.ID); sup != nil {
		return sup.health()
	}
	if !st.Daemon.Alive() {
		return source.Health{Abnormal: true, Reason: "DaemonDown",
			Message: fmt.Sprintf("fuse daemon %s is not running and not supervised yet", st.Daemon.Proc)}
	}
	info, err := fuseAt(st.MountPoint)
	if err != nil || info == nil || connOf(info) != st.Daemon.Conn {
		return source.Health{Abnormal: true, Reason: "MountGone", Message: "the fuse mount at " + st.MountPoint + " is gone"}
	}
	return source.Health{}
}

// statsTimeout bounds NodeGetVolumeStats on a FUSE mount.
const statsTimeout = 2 * time.Second

// Stats measures the daemon's mount with a deadline: a daemon that does
// not answer gives Unavailable, never a hung call. One statfs at most is
// in flight per volume.
func (s *Source) Stats(ctx context.Context, v source.Volume, _ string) (fsutil.Usage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return fsutil.Usage{}, err
	}
	if h := s.Health(ctx, v); h.Abnormal {
		return fsutil.Usage{}, fmt.Errorf("volume %s: %s: %s: %w", v.ID, h.Reason, h.Message, errdefs.ErrUnavailable)
	}
	s.mu.Lock()
	busy := s.statting[v.ID]
	s.statting[v.ID] = true
	s.mu.Unlock()
	if busy {
		return fsutil.Usage{}, fmt.Errorf("volume %s: an earlier statfs of its fuse mount has not returned: %w", v.ID, errdefs.ErrUnavailable)
	}
	type result struct {
		u   fsutil.Usage
		err error
	}
	done := make(chan result, 1)
	go func() {
		u, err := fsutil.Stats(st.MountPoint)
		s.mu.Lock()
		delete(s.statting, v.ID)
		s.mu.Unlock()
		done <- result{u, err}
	}()
	select {
	case r := <-done:
		if errors.Is(r.err, unix.ENOTCONN) || errors.Is(r.err, unix.ECONNABORTED) {
			return fsutil.Usage{}, fmt.Errorf("volume %s: the fuse daemon's connection is gone: %w: %w", v.ID, r.err, errdefs.ErrUnavailable)
		}
		return r.u, r.err
	case <-time.After(statsTimeout):
		return fsutil.Usage{}, fmt.Errorf("volume %s: the fuse daemon did not answer statfs within %v: %w", v.ID, statsTimeout, errdefs.ErrUnavailable)
	case <-ctx.Done():
		return fsutil.Usage{}, ctx.Err()
	}
}
