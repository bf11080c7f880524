package nbd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/periodic"
)

// Reconnect attempts back off from retryMin to retryMax while the server
// does not answer; a watcher that cannot subscribe tries again after
// resubscribe.
var (
	retryMin    = 500 * time.Millisecond
	retryMax    = 30 * time.Second
	resubscribe = 10 * time.Second
)

// link is a staged volume's connection as this process keeps it: the TLS
// proxies that carry the kernel's bytes, and the reconnects under way.
type link struct {
	id  string
	t   target
	st  State
	dev mounter.Device

	ctx    context.Context // ends at unstage (or when the link is replaced)
	cancel context.CancelFunc
	wg     sync.WaitGroup // the reconnect goroutine
	op     sync.Mutex     // one reconnect at a time

	mu       sync.Mutex
	proxies  []*Transmission // TLS: the newest last; stopped ones are dropped
	lost     bool            // the kernel reported the link dead; no reconnect since
	lastErr  error
	retrying bool
}

func (s *Source) deadConnTimeout() time.Duration {
	if s.DeadConnTimeout > 0 {
		return s.DeadConnTimeout
	}
	return DefaultDeadConnTimeout
}

// addLink makes the volume's link (replacing one left over) and makes
// sure the watcher runs, subscribed, before it returns.
func (s *Source) addLink(id string, t target, st State, dev mounter.Device) *link {
	ctx, cancel := context.WithCancel(context.Background())
	l := &link{id: id, t: t, st: st, dev: dev, ctx: ctx, cancel: cancel}
	s.mu.Lock()
	old := s.links[id]
	s.links[id] = l
	s.startWatchLocked()
	s.mu.Unlock()
	old.close()
	return l
}

func (s *Source) linkOf(id string) *link {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.links[id]
}

// linkAt returns the link of device index.
func (s *Source) linkAt(index int) *link {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, l := range s.links {
		if l.st.Index == index {
			return l
		}
	}
	return nil
}

// takeLink forgets the volume's link and stops its reconnects (its
// proxies run on until close); the watcher stops with the last link.
func (s *Source) takeLink(id string) *link {
	s.mu.Lock()
	l := s.links[id]
	delete(s.links, id)
	var w *watcher
	if len(s.links) == 0 {
		w, s.watch = s.watch, nil
	}
	s.mu.Unlock()
	w.stop()
	l.stopRetries()
	return l
}

// dropLink forgets the volume's link and stops everything it runs.
func (s *Source) dropLink(id string) { s.takeLink(id).close() }

// Close stops every proxy, reconnect and watcher of this process and
// disconnects nothing: what the kernel sees when the plugin exits (a TLS
// volume's connection dies and waits for the next plugin's Adopt).
func (s *Source) Close() error {
	s.mu.Lock()
	ids := make([]string, 0, len(s.links))
	for id := range s.links {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	for _, id := range ids {
		s.dropLink(id)
	}
	return nil
}

func (l *link) stopRetries() {
	if l == nil {
		return
	}
	// Under mu: kick checks the context and adds to wg under it too, so
	// no reconnect starts once Wait may run.
	l.mu.Lock()
	l.cancel()
	l.mu.Unlock()
	l.wg.Wait()
}

// close stops the link's reconnects and proxies: the kernel's socket of a
// TLS volume dies with them.
func (l *link) close() {
	if l == nil {
		return
	}
	l.stopRetries()
	l.mu.Lock()
	proxies := l.proxies
	l.proxies = nil
	l.mu.Unlock()
	for _, tr := range proxies {
		_ = tr.Close()
	}
}

func (l *link) addProxy(tr *Transmission) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.proxies = append(l.proxies, tr)
}

// proxyRunning reports whether a proxy of the link still carries bytes,
// dropping those that stopped (the kernel's end closed, or the server's).
func (l *link) proxyRunning() bool {
	l.mu.Lock()
	var stopped, running []*Transmission
	for _, tr := range l.proxies {
		select {
		case <-tr.Done():
			stopped = append(stopped, tr)
		default:
			running = append(running, tr)
		}
	}
	l.proxies = running
	l.mu.Unlock()
	for _, tr := range stopped {
		_ = tr.Close()
	}
	return len(running) > 0
}

func (l *link) setLost(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lost = true
	if err != nil {
		l.lastErr = err
	}
}

// lost reports whether the volume's connection is down in this process's
// view: the kernel reported it dead and no reconnect succeeded since, or
// a TLS volume has no proxy running here.
func (s *Source) lost(id string, st State) (bool, string) {
	l := s.linkOf(id)
	if l == nil {
		if st.TLS {
			return true, "no TLS proxy runs for it in this plugin process (not adopted yet)"
		}
		return false, ""
	}
	if st.TLS && !l.proxyRunning() {
		return true, "its TLS proxy stopped" + l.why()
	}
	l.mu.Lock()
	lost := l.lost
	l.mu.Unlock()
	if lost {
		return true, "the kernel reported the connection dead" + l.why()
	}
	return false, ""
}

func (l *link) why() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lastErr == nil {
		return ""
	}
	return "; last attempt: " + l.lastErr.Error()
}

// kick reconnects l in the background until it succeeds (attempts 0) or
// attempts have failed, backing off in between; one run at a time.
func (s *Source) kick(l *link, attempts int) {
	l.mu.Lock()
	if l.retrying || l.ctx.Err() != nil {
		l.mu.Unlock()
		return
	}
	l.retrying = true
	l.wg.Add(1)
	l.mu.Unlock()
	go func() {
		defer l.wg.Done()
		log := klog.Background().WithValues("volume", l.id, "device", l.st.Device)
		n := 0
		_ = periodic.Backoff(retryMin, retryMax).DelayFunc().Until(l.ctx, true, true, func(ctx context.Context) (bool, error) {
			n++
			err := s.reconnect(ctx, l)
			switch {
			case err == nil, ctx.Err() != nil:
				return true, nil
			case errors.Is(err, errGone):
				log.Info("NBD device no longer connected with the volume's backend; not reconnecting it", "backend", l.st.Backend)
				return true, nil
			case attempts == 1:
				// Adopt's spare socket: the connection most likely lives.
				log.Info("Could not hand the kernel a spare connection for the NBD device; its own lives on unless the kernel reports it dead", "err", err)
			default:
				log.Error(err, "Reconnecting the NBD device failed", "attempt", n)
			}
			return n == attempts, nil
		})
		l.mu.Lock()
		l.retrying = false
		l.mu.Unlock()
	}()
}

// reconnect negotiates the export again and has the mounter give the
// kernel the new socket in place of the dead one (the kernel drops it
// while the connection lives, which makes a needless reconnect harmless).
func (s *Source) reconnect(ctx context.Context, l *link) error {
	l.op.Lock()
	defer l.op.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	if !s.shows(l.st) {
		return errGone
	}
	d, err := s.dialer(l.t, s.timeout())
	if err != nil {
		return err
	}
	start := time.Now()
	tr, err := d.Negotiate(ctx, l.t.export)
	if err != nil {
		l.setLost(err)
		return err
	}
	if tr.Export.Size != l.st.Size {
		tr.Close()
		err := fmt.Errorf("%s now has %d bytes, the device %d: not reconnected: %w", l.t, tr.Export.Size, l.st.Size, errdefs.ErrFailedPrecondition)
		l.setLost(err)
		return err
	}
	err = s.Devices.ReconnectNBD(ctx, l.dev, l.st.Backend, tr.Socket)
	_ = tr.Socket.Close()
	if err != nil {
		tr.Close()
		l.setLost(err)
		return err
	}
	if tr.Proxied() {
		l.addProxy(tr)
	} else {
		tr.Close()
	}
	l.mu.Lock()
	l.lost, l.lastErr = false, nil
	l.mu.Unlock()
	klog.FromContext(ctx).Info("NBD device given a new connection", "volume", l.id, "device", l.st.Device, "server", l.t.server,
		"export", l.t.export, "tls", l.t.tls, "took", time.Since(start))
	return nil
}

// linkWatcher is nbdnl.Watcher as the source uses it.
type linkWatcher interface {
	Next(ctx context.Context) (int, error)
	Close() error
}

// watcher receives the kernel's link-dead notices while any volume is
// connected, and kicks the reconnect of the volume whose device died.
type watcher struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// startWatchLocked subscribes (now, so that a death from here on is
// heard) and starts the watcher, unless it runs.
func (s *Source) startWatchLocked() {
	if s.watch != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &watcher{cancel: cancel, done: make(chan struct{})}
	s.watch = w
	lw, err := s.watchLinks()
	if err != nil {
		klog.Background().Error(err, "Cannot hear of dead NBD connections; trying again", "in", resubscribe)
		lw = nil
	}
	go s.runWatch(ctx, lw, w.done)
}

func (s *Source) runWatch(ctx context.Context, lw linkWatcher, done chan struct{}) {
	defer close(done)
	log := klog.Background()
	for ctx.Err() == nil {
		if lw == nil {
			if wait.PollUntilContextCancel(ctx, resubscribe, false, func(context.Context) (bool, error) {
				var err error
				if lw, err = s.watchLinks(); err != nil {
					log.Error(err, "Cannot hear of dead NBD connections; trying again", "in", resubscribe)
					lw = nil
				}
				return lw != nil, nil
			}) != nil {
				return // ctx ended
			}
		}
		index, err := lw.Next(ctx)
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			log.Error(err, "Listening for dead NBD connections; subscribing again")
			_ = lw.Close()
			lw = nil
			continue
		}
		l := s.linkAt(index)
		if l == nil {
			log.V(2).Info("A connection of an NBD device no volume here uses died", "index", index)
			continue
		}
		log.Info("The kernel reports the NBD device's connection dead; reconnecting", "volume", l.id, "device", l.st.Device)
		l.setLost(nil)
		s.kick(l, 0)
	}
	if lw != nil {
		_ = lw.Close()
	}
}

func (w *watcher) stop() {
	if w == nil {
		return
	}
	w.cancel()
	<-w.done
}
