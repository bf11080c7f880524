package fuse

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// supervisor watches one staged volume's daemon. It never makes an RPC
// wait: requests read its state under a mutex; its probes run in
// goroutines of their own with deadlines; while it restarts a daemon it
// holds the volume's lock, so a request on that volume is Aborted for the
// CO to retry, as during any other operation on it. What it knows of the
// daemon's process comes from the mounter (WaitDaemon, DaemonStatus); what
// it knows of the mount, from the plugin's own mount table and statfs.
type supervisor struct {
	src    *Source
	id     string
	l      layout
	params map[string]string
	log    logr.Logger

	mu sync.Mutex
	st State
	h  source.Health

	cancel context.CancelFunc
	done   chan struct{}

	// Owned by run's goroutine: the backoff of heals that left mounts of
	// dead connections behind.
	healFailures int
	nextHeal     time.Time
}

// Backoff between restarts of a daemon that keeps failing.
const (
	backoffBase = 250 * time.Millisecond
	backoffMax  = 30 * time.Second
	// A daemon that ran at least this long before it failed is restarted
	// at once, its earlier failures forgiven.
	stableAfter = time.Minute
	// reattachTimeout bounds one Host.Reattach call (a heal).
	reattachTimeout = time.Minute
	// statusTimeout bounds a DaemonStatus call. A mounter that did not
	// answer (it restarts) is asked again after mounterRetryMin, doubling
	// up to mounterRetry.
	statusTimeout   = 2 * time.Second
	mounterRetryMin = 25 * time.Millisecond
	mounterRetry    = time.Second
)

func backoff(failures int) time.Duration {
	if failures <= 0 {
		return 0
	}
	d := backoffBase << min(failures-1, 10)
	return min(d, backoffMax)
}

// supervise starts (or replaces) the supervisor of volume id, whose
// parameters (as the record keeps them) a restart hands the mounter.
func (s *Source) supervise(id string, st State, params map[string]string, l layout) {
	ctx, cancel := context.WithCancel(s.ctx)
	sup := &supervisor{src: s, id: id, l: l, params: maps.Clone(params), st: st, cancel: cancel, done: make(chan struct{}),
		log: s.log.WithValues("volume", id)}
	if len(st.Stale) > 0 {
		sup.h = source.Health{Abnormal: true, Reason: "Reattaching",
			Message: fmt.Sprintf("mounts of the dead connections %v of earlier daemons may be left; replacing them", st.Stale)}
	}
	s.mu.Lock()
	old := s.sups[id]
	s.sups[id] = sup
	s.mu.Unlock()
	if old != nil {
		old.halt()
	}
	go sup.run(ctx)
}

func (s *Source) supervisorOf(id string) *supervisor {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sups[id]
}

func (s *Source) takeSupervisor(id string) *supervisor {
	s.mu.Lock()
	defer s.mu.Unlock()
	sup := s.sups[id]
	delete(s.sups, id)
	return sup
}

// halt stops the supervisor and waits until it has stopped. The daemon is
// left as it is.
func (sup *supervisor) halt() {
	sup.cancel()
	<-sup.done
}

func (sup *supervisor) state() State {
	sup.mu.Lock()
	defer sup.mu.Unlock()
	return sup.st
}

func (sup *supervisor) daemon() Daemon { return sup.state().Daemon }

func (sup *supervisor) setDaemon(d Daemon, cmd *daemon.Command) {
	sup.mu.Lock()
	defer sup.mu.Unlock()
	sup.st.Daemon = d
	if cmd != nil {
		sup.st.Command = *cmd
	}
}

// health is the supervisor's last verdict.
func (sup *supervisor) health() source.Health {
	sup.mu.Lock()
	defer sup.mu.Unlock()
	return sup.h
}

func (sup *supervisor) setHealth(reason, msg string) {
	sup.mu.Lock()
	defer sup.mu.Unlock()
	if reason == "" {
		sup.h = source.Health{}
		return
	}
	sup.h = source.Health{Abnormal: true, Reason: reason, Message: msg}
}

func (sup *supervisor) run(ctx context.Context) {
	defer close(sup.done)
	failures := 0
	for {
		sup.heal(ctx) // the mounts of earlier daemons, if any are left
		reason, msg := sup.watch(ctx)
		if ctx.Err() != nil {
			return
		}
		sup.setHealth(reason, msg+"; restarting it")
		if time.Since(sup.daemon().Started) >= stableAfter {
			failures = 0
		}
		sup.log.Info("FUSE daemon failed; restarting it", "reason", reason, "detail", msg, "pid", sup.daemon().PID, "failures", failures)
		pause := wait.DelayFunc(func() time.Duration { return backoff(failures) })
		if pause.Until(ctx, false, true, func(ctx context.Context) (bool, error) {
			failures++
			err := sup.restart(ctx)
			if err != nil && ctx.Err() == nil {
				sup.log.Error(err, "Restarting the FUSE daemon failed", "failures", failures)
				sup.setHealth("RestartFailed", err.Error())
			}
			return err == nil, nil
		}) != nil {
			return // ctx ended
		}
		d := sup.daemon()
		sup.setHealth("Reattaching", fmt.Sprintf("fuse daemon restarted as %s; replacing the dead mounts of its predecessors wherever they are", d.Proc))
		sup.healFailures, sup.nextHeal = 0, time.Time{}
		sup.log.Info("FUSE daemon restarted", "pid", d.PID, "conn", d.Conn, "generation", d.Generation)
	}
}

type probeResult struct{ err error }

// waitExit returns a channel closed when the mounter says d has exited
// (or that it is no daemon it knows, which it cannot watch then either).
// A mounter that cannot be reached (it restarts) is asked again.
func (sup *supervisor) waitExit(ctx context.Context, p daemon.Proc) <-chan struct{} {
	exited := make(chan struct{})
	go func() {
		_ = periodic.Backoff(mounterRetryMin, mounterRetry).DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
			err := sup.src.daemons.WaitDaemon(ctx, p)
			switch {
			case ctx.Err() != nil:
				return true, nil
			case err == nil, errors.Is(err, errdefs.ErrNotFound):
				close(exited)
				return true, nil
			}
			sup.log.V(2).Info("Cannot watch the daemon for now", "pid", p.PID, "err", err)
			return false, nil
		})
	}()
	return exited
}

// watch returns when the daemon needs a restart: it exited, its mount is
// gone, its connection was cut, or it has not answered a statfs for the
// probe timeout while requests wait on its connection.
func (sup *supervisor) watch(ctx context.Context) (reason, msg string) {
	d := sup.daemon()
	if d.PID <= 0 {
		return "DaemonDown", "no fuse daemon is recorded for the volume"
	}
	if r, m := sup.checkMount(d); r != "" {
		return r, m
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	exited := sup.waitExit(wctx, d.Proc)
	tick := time.NewTicker(sup.src.probe)
	defer tick.Stop()
	results := make(chan probeResult, 1)
	var inFlight time.Time // start of the probe still running, or zero
	for {
		select {
		case <-ctx.Done():
			return "", ""
		case <-exited:
			return sup.whyExited(ctx, d)
		case r := <-results:
			inFlight = time.Time{}
			if errors.Is(r.err, unix.ENOTCONN) || errors.Is(r.err, unix.ECONNABORTED) {
				return "Disconnected", fmt.Sprintf("the fuse mount of %s answers %v", d.Proc, r.err)
			}
		case <-tick.C:
			if r, m := sup.checkMount(d); r != "" {
				return r, m
			}
			if sup.healDue() {
				sup.heal(ctx)
			}
			if inFlight.IsZero() {
				inFlight = time.Now()
				go func() {
					_, err := fsutil.Stats(sup.l.mnt())
					results <- probeResult{err: err}
				}()
				continue
			}
			if since := time.Since(inFlight); since >= sup.src.deadline {
				if r, m := sup.checkHung(ctx, d, since); r != "" {
					return r, m
				}
			}
		}
	}
}

// whyExited asks the mounter why d died: the kernel's OOM killer at the
// profile's memory limit is OOMKilled, anything else (or a mounter that
// cannot say) DaemonDown.
func (sup *supervisor) whyExited(ctx context.Context, d Daemon) (reason, msg string) {
	sctx, cancel := context.WithTimeout(ctx, statusTimeout)
	st, err := sup.src.daemons.DaemonStatus(sctx, d.Proc, 0)
	cancel()
	if err == nil && st.Reason != "" {
		return st.Reason, st.Detail
	}
	return "DaemonDown", fmt.Sprintf("fuse daemon %s exited", d.Proc)
}

// checkHung asks the mounter about a daemon whose statfs has been
// unanswered for since: requests waiting on its connection (or a
// connection that is gone) mean it hangs; a mounter that cannot be
// reached leaves it to the next tick.
func (sup *supervisor) checkHung(ctx context.Context, d Daemon, since time.Duration) (reason, msg string) {
	sctx, cancel := context.WithTimeout(ctx, statusTimeout)
	st, err := sup.src.daemons.DaemonStatus(sctx, d.Proc, d.Conn)
	cancel()
	switch {
	case ctx.Err() != nil || errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded):
		return "", ""
	case err == nil && !st.Alive:
		return "DaemonDown", fmt.Sprintf("fuse daemon %s exited", d.Proc)
	case err != nil || st.Waiting > 0:
		return "DaemonHung", fmt.Sprintf("fuse daemon %s has not answered a statfs for %v (%d requests waiting)", d.Proc, since.Round(time.Second), st.Waiting)
	}
	return "", ""
}

// checkMount reports a daemon whose mount is no longer on top of its
// mount point, as the plugin's mount table says.
func (sup *supervisor) checkMount(d Daemon) (reason, msg string) {
	info, err := mountns.FuseAt(sup.l.mnt())
	if err != nil {
		return "", "" // cannot tell; the next tick retries
	}
	if info == nil || connOf(info) != d.Conn {
		return "MountGone", fmt.Sprintf("the fuse mount of %s at %s is gone", d.Proc, sup.l.mnt())
	}
	return "", ""
}

// restart replaces the daemon, holding the volume's lock as an RPC
// would. The volume's record follows every incarnation (through the
// driver's Recorder), so a crash of the plugin at any point leaves the
// newest daemon recorded for the next to adopt.
func (sup *supervisor) restart(ctx context.Context) error {
	host := sup.src.getHost()
	if host == nil {
		return sup.replaceDaemon(ctx, sup.params, nil) // a test without a driver
	}
	return host.WithVolume(ctx, sup.id, "fuse-restart", func(v source.Volume, found bool, rec source.Recorder) error {
		if !found {
			return fmt.Errorf("volume %s has no record any more: %w", sup.id, errdefs.ErrNotFound)
		}
		return sup.replaceDaemon(ctx, v.Parameters, rec)
	})
}

// replaceDaemon has the mounter stop the failed daemon (its connection
// aborted, so callers blocked on it return; its session killed; the dead
// mount lazily unmounted; the directory and secrets kept) and start the
// next generation on the same mount point. The old connection is recorded
// as stale first, so that its mounts are healed even after a crash.
func (sup *supervisor) replaceDaemon(ctx context.Context, params map[string]string, rec source.Recorder) error {
	old := sup.daemon()
	st := sup.markStale(old.Conn)
	if err := source.SaveState(rec, st); err != nil {
		return err
	}
	var known []daemon.Proc
	if old.PID > 0 {
		known = append(known, old.Proc)
	}
	if err := sup.src.daemons.StopDaemons(ctx, sup.id, known, false); err != nil {
		return err
	}
	gen := old.Generation + 1
	started := time.Now()
	info, err := sup.src.daemons.StartDaemon(ctx, mounter.DaemonRequest{VolumeID: sup.id, Profile: st.Profile, Params: params,
		ReadOnly: st.ReadOnly, MountGroup: st.MountGroup, Generation: gen, ReadyTimeout: st.ReadyTimeout, SELinuxContext: st.SELinuxContext})
	sup.src.metrics.ObserveStep("daemon_start", err, time.Since(started))
	if err != nil {
		// The failed generation stays the current one, so that the next
		// attempt counts on from it.
		sup.setDaemon(Daemon{Generation: gen, Started: started.UTC()}, nil)
		return err
	}
	sup.setDaemon(Daemon{Generation: gen, Proc: info.Proc, Conn: info.Conn, Started: started.UTC()}, &info.Command)
	sup.src.metrics.DaemonRestarted(st.Profile)
	return source.SaveState(rec, sup.state())
}

// heal has the driver replace every mount of the stale connections (of
// earlier daemons) with the current daemon's, in every mount namespace of
// the node, and re-attach recorded consumers and publishes; then it
// forgets the connections of which no mount is left. Health stays
// abnormal while any is left; watch tries again after a backoff.
func (sup *supervisor) heal(ctx context.Context) {
	st := sup.state()
	if len(st.Stale) == 0 || st.Daemon.PID <= 0 {
		return // nothing to heal, or no daemon to heal with: watch sees it
	}
	host := sup.src.getHost()
	if host == nil { // a test without a driver
		sup.keepStale(ctx, nil)
		sup.setHealth("", "")
		return
	}
	rctx, cancel := context.WithTimeout(ctx, reattachTimeout)
	res, err := host.Reattach(rctx, sup.id, plan.Heal{Dead: st.Stale, Source: st.BindSource})
	cancel()
	if ctx.Err() != nil {
		return
	}
	var left []uint64
	for _, l := range res.Left {
		left = append(left, l.Conn)
	}
	sup.keepStale(ctx, left)
	switch {
	case err != nil:
		sup.healFailed()
		sup.log.Error(err, "Re-attaching the restarted FUSE mount failed", "attempt", sup.healFailures)
		sup.setHealth("ReattachFailed", err.Error())
	case len(res.Left) > 0:
		sup.healFailed()
		sup.log.Info("Mounts of dead FUSE connections are left", "left", len(res.Left), "first", res.Left[0].String(), "attempt", sup.healFailures)
		sup.setHealth("StaleMounts", fmt.Sprintf("%d mounts of the dead connections of earlier daemons are left; first %s", len(res.Left), res.Left[0]))
	default:
		sup.healFailures = 0
		sup.setHealth("", "")
		sup.log.Info("Every mount of the earlier daemons' connections replaced", "healed", len(res.Healed), "conn", st.Daemon.Conn)
	}
}

// healDue says whether a heal is pending and its backoff has passed.
func (sup *supervisor) healDue() bool {
	return len(sup.state().Stale) > 0 && !time.Now().Before(sup.nextHeal)
}

func (sup *supervisor) healFailed() {
	sup.healFailures++
	sup.nextHeal = time.Now().Add(backoff(sup.healFailures))
}

// markStale adds the connection of a daemon being replaced to those whose
// mounts must be healed. The oldest are dropped past maxStale.
func (sup *supervisor) markStale(conn uint64) State {
	sup.mu.Lock()
	defer sup.mu.Unlock()
	if conn != 0 && !slices.Contains(sup.st.Stale, conn) {
		sup.st.Stale = append(slices.Clone(sup.st.Stale), conn)
		if n := len(sup.st.Stale); n > maxStale {
			sup.st.Stale = slices.Clone(sup.st.Stale[n-maxStale:])
		}
	}
	return sup.st
}

// maxStale is how many dead connections a volume keeps healing.
const maxStale = 32

// keepStale forgets the stale connections not in left and records the
// change.
func (sup *supervisor) keepStale(ctx context.Context, left []uint64) {
	sup.mu.Lock()
	n := len(sup.st.Stale)
	// A new slice: copies of the state handed out share the old one.
	sup.st.Stale = slices.DeleteFunc(slices.Clone(sup.st.Stale), func(c uint64) bool { return !slices.Contains(left, c) })
	changed := len(sup.st.Stale) != n
	sup.mu.Unlock()
	host := sup.src.getHost()
	if !changed || host == nil {
		return
	}
	err := host.WithVolume(ctx, sup.id, "fuse-healed", func(_ source.Volume, found bool, rec source.Recorder) error {
		if !found {
			return nil
		}
		return source.SaveState(rec, sup.state())
	})
	if err != nil && ctx.Err() == nil {
		sup.log.Error(err, "Recording the healed connections failed; the next heal finds nothing to replace and records it")
	}
}
