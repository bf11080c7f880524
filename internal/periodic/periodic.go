// Package periodic holds the shapes of mountplan's background waits, on
// k8s.io/apimachinery/pkg/util/wait, each ending when its context does:
// Every and Retry for the background work (the reconciler, the FUSE orphan
// sweep), and Backoff for loops that retry until they succeed or their
// context ends (Backoff(first, limit).DelayFunc().Until(ctx, ...)); a poll
// at a fixed interval is wait.PollUntilContextCancel or
// wait.PollUntilContextTimeout. Not every loop goes through it: the FUSE
// supervisor's probe, health events and the registration check keep a
// ticker of their own, and a few one-step waits (iSCSI's device, the
// plan's retry, a cgroup's emptying) a timer.
package periodic

import (
	"context"
	"math"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// Every calls fn every interval until ctx ends or fn returns false. The
// first call comes one interval after the start: a caller that wants one
// at once makes it before. A call that outlasts the interval delays the
// next instead of piling calls up.
func Every(ctx context.Context, interval time.Duration, fn func(context.Context) bool) {
	_ = wait.PollUntilContextCancel(ctx, interval, false, func(ctx context.Context) (bool, error) {
		return !fn(ctx), nil
	})
}

// Retry calls fn again while it fails, first after first and then after
// twice as long each time, until fn succeeds, ctx ends or the next wait
// would exceed limit (the caller's regular interval takes over there). It
// reports whether fn succeeded.
func Retry(ctx context.Context, first, limit time.Duration, fn func(context.Context) error) bool {
	if first <= 0 || first > limit {
		return false
	}
	ok, next := false, first
	_ = Backoff(first, limit).DelayFunc().Until(ctx, false, true, func(ctx context.Context) (bool, error) {
		ok = fn(ctx) == nil
		next *= 2
		return ok || next > limit, nil
	})
	return ok
}

// Backoff waits first, then twice as long each time up to limit, then
// limit for as long as the loop runs.
func Backoff(first, limit time.Duration) wait.Backoff {
	return wait.Backoff{Duration: first, Factor: 2, Cap: limit, Steps: math.MaxInt32}
}
