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
