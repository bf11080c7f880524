// Package periodic runs the plugin's background loops (the reconciler,
// the FUSE orphan sweep, polling a daemon's exit) in one way.
package periodic

import (
	"context"
	"time"
)

// Every calls fn every interval until ctx ends or fn returns false. The
// first call comes one interval after the start: a caller that wants one
// at once makes it before. A call that outlasts the interval delays the
// next instead of piling calls up.
func Every(ctx context.Context, interval time.Duration, fn func(context.Context) bool) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !fn(ctx) {
				return
			}
		}
	}
}

// Retry calls fn again while it fails, first after wait and then after
// twice as long each time, until fn succeeds, ctx ends or the next wait
// would exceed limit (the caller's regular interval takes over there). It
// reports whether fn succeeded.
func Retry(ctx context.Context, wait, limit time.Duration, fn func(context.Context) error) bool {
	for ; wait <= limit; wait *= 2 {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		if fn(ctx) == nil {
			return true
		}
	}
	return false
}
