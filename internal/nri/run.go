package nri

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/nri/pkg/stub"
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
// until ctx ends, connecting again (after a second, backing off up to 10s)
// whenever the runtime goes away or is not there yet. The guard runs from
// each Synchronize until that connection ends.
func Run(ctx context.Context, socket string, h *Hook) error {
	logger := klog.FromContext(ctx).WithValues("nriSocket", socket)
	ctx = klog.NewContext(ctx, logger)
	h.bg.Store(&ctx)
	defer h.close()
	reconnect(ctx, periodic.Backoff(time.Second, 10*time.Second), func(ctx context.Context) bool {
		registered, err := runOnce(ctx, socket, h)
		h.stopGuard(ctx)
		if ctx.Err() == nil {
			logger.Info("No NRI connection; connecting again after a pause (1s, doubling up to 10s)", "err", err)
		}
		return registered
	})
	return nil
}

// reconnect calls connect at once and again after each return, pausing as
// backoff says, until ctx ends. A connection that registered starts the
// backoff over: after a runtime restart the first try comes after the
// first pause, not after the longest one an earlier outage left (the hook
// stayed away, and the guard down, 10s after each later restart).
func reconnect(ctx context.Context, backoff wait.Backoff, connect func(context.Context) (registered bool)) {
	next := backoff.DelayFunc()
	// sliding: the pause is taken after connect returns, so from the
	// fresh backoff when it registered.
	_ = wait.DelayFunc(func() time.Duration { return next() }).Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		if connect(ctx) {
			next = backoff.DelayFunc()
		}
		return false, nil
	})
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
