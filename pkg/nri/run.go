package nri

import (
	"context"
	"fmt"
	"time"

	"github.com/containerd/nri/pkg/stub"
	"k8s.io/klog/v2"
)

// PluginName and PluginIndex are how the runtime knows the hook: plugins
// are called in index order.
const (
	PluginName  = "mountplan"
	PluginIndex = "50"
)

// Run registers h (a *Hook, or anything that wraps one and implements the
// stub's handler interfaces) with the runtime's NRI socket and serves its events until
// ctx ends, connecting again (after a second, then backing off up to 10s)
// whenever the runtime goes away or is not there yet. registered, when not
// nil, is told true once the runtime has configured and synchronized the
// hook and false when the connection is lost.
func Run(ctx context.Context, socket string, h stub.Plugin, registered func(bool)) error {
	logger := klog.FromContext(ctx).WithValues("nriSocket", socket)
	backoff := time.Second
	for {
		err := runOnce(ctx, socket, h, registered)
		if registered != nil {
			registered(false)
		}
		if ctx.Err() != nil {
			return nil
		}
		logger.Info("NRI connection ended; connecting again", "err", err, "after", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 10*time.Second)
	}
}

func runOnce(ctx context.Context, socket string, h stub.Plugin, registered func(bool)) error {
	s, err := stub.New(h,
		stub.WithPluginName(PluginName), stub.WithPluginIdx(PluginIndex),
		stub.WithSocketPath(socket), stub.WithLogger(logAdapter{klog.FromContext(ctx)}))
	if err != nil {
		return fmt.Errorf("NRI stub: %w", err)
	}
	if err := s.Start(ctx); err != nil {
		return fmt.Errorf("registering with the runtime: %w", err)
	}
	if registered != nil {
		registered(true)
	}
	done := make(chan struct{})
	go func() { s.Wait(); close(done) }()
	select {
	case <-ctx.Done():
		s.Stop()
	case <-done:
	}
	return nil
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
