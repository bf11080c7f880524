package nri

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/containerd/nri/pkg/stub"
	"github.com/fsnotify/fsnotify"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/periodic"
)

// PluginName and PluginIndex are how the runtime knows the hook: plugins
// are called in index order.
const (
	PluginName  = "mountplan"
	PluginIndex = "50"
)

// Run registers h with the runtime's NRI socket and serves its events
// until ctx ends, connecting again (after a second, backing off up to 10s,
// or as soon as the runtime makes its socket again) whenever the runtime
// goes away or is not there yet. The guard runs from each Synchronize
// until that connection ends.
func Run(ctx context.Context, socket string, h *Hook) error {
	logger := klog.FromContext(ctx).WithValues("nriSocket", socket)
	ctx = klog.NewContext(ctx, logger)
	h.bg.Store(&ctx)
	defer h.close()
	appeared := socketAppears(ctx, socket)
	reconnect(ctx, periodic.Backoff(time.Second, 10*time.Second), appeared, func(ctx context.Context) bool {
		registered, err := runOnce(ctx, socket, h)
		h.stopGuard(ctx)
		if ctx.Err() == nil {
			logger.Info("No NRI connection; connecting again after a pause (1s, doubling up to 10s) or when the runtime makes its socket", "err", err)
		}
		return registered
	})
	return nil
}

// reconnect calls connect at once and again after each return, pausing as
// backoff says, until ctx ends. A connection that registered starts the
// backoff over: after a runtime restart the first try comes after the
// first pause, not after the longest one an earlier outage left (the hook
// stayed away, and the guard down, 10s after each later restart). A
// runtime that comes back (appeared: it made its socket again) ends the
// pause at once and starts the backoff over: after a long outage the hook
// registered up to 10s after the runtime served, and meanwhile the guard
// was down and every publish of an NRI volume on the node refused.
func reconnect(ctx context.Context, backoff wait.Backoff, appeared <-chan struct{}, connect func(context.Context) (registered bool)) {
	next := backoff.DelayFunc()
	for ctx.Err() == nil {
		if connect(ctx) {
			next = backoff.DelayFunc()
		}
		pause := time.NewTimer(next())
		select {
		case <-ctx.Done():
		case <-pause.C:
		case <-appeared:
			next = backoff.DelayFunc()
		}
		pause.Stop()
	}
}

// socketAppears signals (coalesced) each time a file is made at socket's
// path (created, or moved there), until ctx ends: the runtime binds its
// NRI socket anew at each start. Without a watch (the directory is
// missing, inotify refused) it never signals, and the pauses alone pace
// the tries.
func socketAppears(ctx context.Context, socket string) <-chan struct{} {
	appeared := make(chan struct{}, 1)
	logger := klog.FromContext(ctx)
	w, err := fsnotify.NewWatcher()
	if err == nil {
		err = w.Add(filepath.Dir(socket))
		if err != nil {
			w.Close()
		}
	}
	if err != nil {
		logger.Info("Not watching for the runtime's NRI socket; tries to connect follow the pauses alone", "err", err)
		return appeared
	}
	socket = filepath.Clean(socket)
	go func() {
		defer w.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if ev.Has(fsnotify.Create) && filepath.Clean(ev.Name) == socket {
					select {
					case appeared <- struct{}{}:
					default: // one signal pending is enough
					}
				}
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				logger.V(2).Info("Watch of the NRI socket's directory", "err", err)
			}
		}
	}()
	return appeared
}

// runOnce serves one connection to the runtime until it ends; registered
// says whether the runtime took the registration.
func runOnce(ctx context.Context, socket string, h *Hook) (registered bool, _ error) {
	s, err := stub.New(h,
		stub.WithPluginName(PluginName), stub.WithPluginIdx(PluginIndex),
		stub.WithSocketPath(socket), stub.WithLogger(logAdapter{klog.FromContext(ctx)}))
	if err != nil {
		return false, fmt.Errorf("NRI stub: %w", err)
	}
	if err := s.Start(ctx); err != nil {
		return false, fmt.Errorf("registering with the runtime: %w", err)
	}
	h.runtimeSays(s.RequestTimeout())
	klog.FromContext(ctx).Info("Registered with the runtime", "plugin", PluginIndex+"-"+PluginName,
		"runtimeRequestTimeout", s.RequestTimeout(), "hookTimeout", h.timeout())
	done := make(chan struct{})
	go func() { s.Wait(); close(done) }()
	select {
	case <-ctx.Done():
		s.Stop()
	case <-done:
	}
	return true, errors.New("connection closed")
}

// logAdapter sends the NRI library's log lines to klog.
type logAdapter struct{ l klog.Logger }

func (a logAdapter) Debugf(_ context.Context, f string, args ...any) {
	a.l.V(4).Info(fmt.Sprintf(f, args...))
}
func (a logAdapter) Infof(_ context.Context, f string, args ...any) {
	a.l.V(2).Info(fmt.Sprintf(f, args...))
}
func (a logAdapter) Warnf(_ context.Context, f string, args ...any) {
	a.l.Info(fmt.Sprintf(f, args...))
}
func (a logAdapter) Errorf(_ context.Context, f string, args ...any) {
	a.l.Error(nil, fmt.Sprintf(f, args...))
}
