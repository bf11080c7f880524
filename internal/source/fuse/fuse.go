// Package fuse is the FUSE volume source: a daemon from an admin-defined
// profile (sshfs, rclone mount, squashfuse, ...) mounts the volume under
// the plugin's state dir, and the plan binds that mount into each
// consumer.
//
// The plugin only decides and parses: it checks a volume's profile,
// parameters and secrets, and asks the mounter (mounter.Daemons) for
// everything else: the volume's directory and secrets, the daemon's start
// (from the mounter's own copy of the profile), its exit, its waiting
// requests, its stop. The plugin sees the daemon's mount in its own mount
// table (the state dir's mounts reach it by propagation) and measures it
// itself, with deadlines.
//
// Daemons outlive the plugin process (they are the mounter's children),
// and the journal records each one's PID, start time and FUSE connection,
// so a restarted plugin adopts it instead of starting another. A
// supervisor per staged volume restarts a daemon that exited or stopped
// answering, then has the driver re-attach the new mount at every
// consumer and publish (Host.Reattach), so running containers heal in
// place. Nothing here ever stats a path that may be a dead FUSE mount
// without a deadline: health and stats answer from probes.
package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Type is the volume_context type of this source.
const Type = "fuse"

// State is what the journal keeps of a staged FUSE volume.
type State struct {
	Profile string `json:"profile"`
	// Command is what the mounter started (paths of secret files, never
	// secrets).
	Command daemon.Command `json:"command"`
	// MountPoint is where the daemon mounts, as the plugin's mount table
	// shows it (state dir symlinks resolved); BindSource is the same
	// directory as the plan names it.
	MountPoint   string        `json:"mountPoint"`
	BindSource   string        `json:"bindSource"`
	ReadOnly     bool          `json:"readOnly,omitempty"`
	MountGroup   *uint32       `json:"mountGroup,omitempty"` // the pod's fsGroup at stage (mountGroupArgs)
	Secrets      bool          `json:"secrets,omitempty"`    // the mounter keeps a secrets tmpfs
	ReadyTimeout time.Duration `json:"readyTimeout"`
	// SELinuxContext labels the daemon's mount (the stage's context=
	// flag), and every restart's mount again.
	SELinuxContext string `json:"seLinuxContext,omitempty"`
	Daemon         Daemon `json:"daemon"`
	// Stale are the connections of earlier daemons whose mounts may still
	// sit in some mount namespace (a container's copy): the supervisor has
	// them replaced with the current daemon's and forgets each once none
	// is left. The volume is not healthy while one is listed.
	Stale []uint64 `json:"staleConns,omitempty"`
}

// Daemon is one incarnation of a volume's daemon.
type Daemon struct {
	// Generation counts starts: 1 at stage, +1 on every restart.
	Generation int `json:"generation"`
	daemon.Proc
	// Conn is the FUSE connection ID (the mount's device number) once the
	// mount appeared; 0 before.
	Conn    uint64    `json:"conn,omitempty"`
	Started time.Time `json:"started"`
}

// Options configure a Source.
type Options struct {
	// StateDir is the plugin's state dir; volumes live under StateDir/fuse.
	StateDir string
	// Profiles are the admin's FUSE profiles (the plugin's copy, for its
	// checks; the mounter renders from its own).
	Profiles []fuseprofile.Profile
	// Daemons is the mounter, which runs the daemons.
	Daemons mounter.Daemons
	// Metrics times daemon starts and counts restarts (nil: not recorded).
	Metrics *metrics.Metrics
	// ProbeInterval is how often a supervisor checks that its daemon
	// answers (default 2s); ProbeTimeout is how long a statfs may take
	// before the daemon counts as hung (default 5s).
	ProbeInterval, ProbeTimeout time.Duration
}

// Source stages FUSE volumes through the mounter. Create it with New; Run
// sweeps orphans and ends supervision when its context ends.
type Source struct {
	stateDir string
	profiles []fuseprofile.Profile
	daemons  mounter.Daemons
	metrics  *metrics.Metrics
	probe    time.Duration
	deadline time.Duration

	log klog.Logger

	mu       sync.Mutex
	host     source.Host
	sups     map[string]*supervisor
	statting map[string]bool
	fuseAt   func(string) (*mountinfo.Info, error) // mountns.FuseAt, or a test's
	mounted  func(string) (bool, error)            // mountinfo.Mounted, or a test's
	ctx      context.Context                       // parent of the supervisors
	stop     context.CancelFunc
	realDir  string
}

var (
	_ source.Source        = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
	_ source.Statter       = (*Source)(nil)
	_ source.HostUser      = (*Source)(nil)
	_ source.FileOwner     = (*Source)(nil)
	_ source.Runner        = (*Source)(nil)
)

// OwnsFiles says that a FUSE volume's files are the daemon's to own: the
// driver does not give them to kubelet's fsGroup.
func (s *Source) OwnsFiles() {}

// New returns a FUSE source. It starts nothing.
func New(o Options) (*Source, error) {
	dir, err := filepath.Abs(o.StateDir)
	if err != nil {
		return nil, err
	}
	s := &Source{
		stateDir: dir,
		profiles: o.Profiles,
		daemons:  o.Daemons,
		metrics:  o.Metrics,
		probe:    o.ProbeInterval,
		deadline: o.ProbeTimeout,
		log:      klog.Background().WithName("fuse"),
		sups:     map[string]*supervisor{},
		statting: map[string]bool{},
		fuseAt:   mountns.FuseAt,
		mounted:  mountinfo.Mounted,
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

func (s *Source) mounter() (mounter.Daemons, error) {
	if s.daemons == nil {
		return nil, fmt.Errorf("fuse: no mounter to run daemons: %w", errdefs.ErrFailedPrecondition)
	}
	return s.daemons, nil
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

// layout is a volume's directory as the plugin sees it,
// <state-dir>/fuse/<volume-id>/ (made by the mounter).
type layout struct{ dir string }

func (l layout) mnt() string { return filepath.Join(l.dir, "mnt") }

func (s *Source) layout(id string) (layout, error) {
	if err := model.ValidID(id); err != nil {
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
	return source.Volume{ID: id, Kind: model.KindStatic, Parameters: params}, nil
}

// Stage checks the volume's profile, parameters and secrets, has the
// mounter start the daemon on <state-dir>/fuse/<id>/mnt (it returns once
// the mount serves), and starts supervising it.
func (s *Source) Stage(ctx context.Context, v source.Volume, req source.StageRequest) (_ json.RawMessage, err error) {
	if req.Block {
		return nil, invalid("fuse volumes have no block access")
	}
	// Checked again: the config may have changed since NewVolume. The
	// mounter checks everything once more, against its own config, and
	// resolves a path source where the daemon runs.
	params, p, err := fuseprofile.VolumeParams(s.profiles, v.Parameters)
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if err := checkSecrets(p, req.Secrets); err != nil {
		return nil, err
	}
	m, err := s.mounter()
	if err != nil {
		return nil, err
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
		if err := m.StopDaemons(ctx, v.ID, nil, true); err != nil {
			return nil, err
		}
	}
	st := State{Profile: p.Name, MountPoint: l.mnt(), BindSource: filepath.Join(s.stateDir, "fuse", v.ID, "mnt"),
		ReadOnly: req.ReadOnly, MountGroup: req.MountGroup, Secrets: len(req.Secrets) > 0, ReadyTimeout: p.ReadyTimeout.Duration,
		SELinuxContext: req.SELinuxContext}
	if st.ReadyTimeout == 0 {
		st.ReadyTimeout = 30 * time.Second
	}
	// Recorded before the mounter acts: an unstage after a crash finds it.
	if err := source.SaveState(req.Record, st); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if serr := m.StopDaemons(context.WithoutCancel(ctx), v.ID, nil, true); serr != nil {
				klog.FromContext(ctx).Error(serr, "Rollback of a failed FUSE stage left something behind", "volume", v.ID)
			}
		}
	}()
	started := time.Now()
	info, err := m.StartDaemon(ctx, mounter.DaemonRequest{VolumeID: v.ID, Profile: p.Name, Params: params, ReadOnly: req.ReadOnly,
		MountGroup: req.MountGroup, Secrets: req.Secrets, Generation: 1, ReadyTimeout: st.ReadyTimeout, SELinuxContext: req.SELinuxContext})
	s.metrics.ObserveStep("daemon_start", err, time.Since(started))
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	st.Command, st.BindSource = info.Command, info.BindSource
	st.Daemon = Daemon{Generation: 1, Proc: info.Proc, Conn: info.Conn, Started: started.UTC()}
	raw, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	s.supervise(v.ID, st, params, l)
	klog.FromContext(ctx).V(2).Info("FUSE daemon serving", "pid", st.Daemon.PID, "conn", st.Daemon.Conn, "mountPoint", st.MountPoint)
	return raw, nil
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
	// The label is the daemon's mount's (made at stage, as the driver
	// checked the request's against the stage's): a bind cannot take it.
	flags := plan.WithoutContext(req.MountFlags)
	if err := plan.CheckBindOptions(flags); err != nil {
		return nil, fmt.Errorf("fuse volume %s: %w", v.ID, err)
	}
	// Without the daemon's mount the bind would give the consumer the
	// empty directory under it, on the node's disk (after a reboot, until
	// the supervisor or a new stage has the daemon serving again): the CO
	// retries instead.
	if !s.serving(st) {
		return nil, fmt.Errorf("fuse volume %s: no daemon serves at %s yet: %w", v.ID, st.MountPoint, errdefs.ErrUnavailable)
	}
	opts := plan.Options([]string{"nosuid", "nodev"}, req.ReadOnly || st.ReadOnly, flags...)
	return []plan.Mount{{Type: plan.TypeBind, Source: st.BindSource, Options: opts}}, nil
}

// Unstage stops supervising and has the mounter stop the daemon (SIGTERM,
// then SIGKILL), unmount what is left under the volume's directory, and
// remove its secrets and files. It works from the disk alone when the
// record has no state (a stage interrupted by a crash). Idempotent.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	var known Daemon
	if sup := s.takeSupervisor(v.ID); sup != nil {
		sup.halt()
		known = sup.daemon()
	}
	if st, err := source.DecodeState[State](v); err == nil && st.Daemon.Generation > known.Generation {
		known = st.Daemon
	}
	if _, err := s.layout(v.ID); err != nil {
		return err
	}
	m, err := s.mounter()
	if err != nil {
		return err
	}
	var procs []daemon.Proc
	if known.PID > 0 {
		procs = append(procs, known.Proc)
	}
	if err := m.StopDaemons(ctx, v.ID, procs, true); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	klog.FromContext(ctx).V(2).Info("FUSE volume torn down", "volume", v.ID)
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
	if _, err := os.Lstat(l.dir); err != nil {
		return nil, fmt.Errorf("volume %s: its directory %s is gone: %w", v.ID, l.dir, errdefs.ErrFailedPrecondition)
	}
	if st.Secrets && !s.serving(st) && !s.isMounted(filepath.Join(l.dir, "secrets")) {
		// A reboot: the daemon, its mount and its secrets' tmpfs are gone,
		// and the mounter cannot start it again without the secrets, which
		// only a stage request carries.
		return nil, fmt.Errorf("volume %s: its FUSE daemon and its secrets are gone: %w", v.ID, source.ErrNeedsStage)
	}
	klog.FromContext(ctx).Info("Supervising FUSE daemon", "pid", st.Daemon.PID, "conn", st.Daemon.Conn, "generation", st.Daemon.Generation)
	s.supervise(v.ID, st, v.Parameters, l)
	return json.Marshal(st)
}

// serving says whether the daemon's mount is on top at its mount point,
// as the plugin's mount table says.
func (s *Source) serving(st State) bool {
	info, err := s.fuseAt(st.MountPoint)
	return err == nil && info != nil
}

func (s *Source) isMounted(p string) bool {
	mounted, err := s.mounted(p)
	return err == nil && mounted
}

// Health answers from the supervisor's view, or before there is one from
// the plugin's mount table (the daemon's connection still mounted); it
// never touches the mount.
func (s *Source) Health(_ context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	if sup := s.supervisorOf(v.ID); sup != nil {
		return sup.health()
	}
	info, err := mountns.FuseAt(st.MountPoint)
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

// Describe names the profile and the daemon's PID as
// recorded.
func (s *Source) Describe(v source.Volume) source.Description {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Description{Source: "fuse"}
	}
	return source.Description{Source: "fuse profile " + st.Profile, DaemonPID: st.Daemon.PID}
}
