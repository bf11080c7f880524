package unixrpc

import (
	"context"
	"errors"
	"sync"
	"time"
)

// deadlines ends calls at their client's deadline with one timer for the
// whole server. A timer per call (context.WithDeadline) wakes an idle
// thread each time it is set, as a goroutine per call did for hangups
// (BenchmarkCall's deadline/ against none/). This one is set only when a
// call's deadline comes before that of every call in flight, and it is
// left set when the calls it was set for end: it then fires once for
// nothing. Calls a few seconds or minutes apart with deadlines minutes
// away (kubelet's) set it about once per deadline's length.
type deadlines struct {
	mu    sync.Mutex
	calls map[*deadlineCall]struct{}
	timer *time.Timer
	at    time.Time // when timer fires; zero: it does not
}

type deadlineCall struct {
	at     time.Time
	cancel context.CancelCauseFunc
}

// start returns a context of ctx that ends at the deadline at; done
// forgets it (the caller cancels ctx).
func (d *deadlines) start(ctx context.Context, at time.Time) (_ context.Context, done func()) {
	if cur, ok := ctx.Deadline(); ok && !at.Before(cur) {
		return ctx, func() {} // ctx ends first
	}
	ctx, cancel := context.WithCancelCause(ctx)
	call := &deadlineCall{at: at, cancel: cancel}
	if !time.Now().Before(at) {
		cancel(context.DeadlineExceeded)
		return deadlineCtx{Context: ctx, deadline: at}, func() {}
	}
	d.mu.Lock()
	if d.calls == nil {
		d.calls = map[*deadlineCall]struct{}{}
	}
	d.calls[call] = struct{}{}
	if d.at.IsZero() || at.Before(d.at) {
		d.arm(at)
	}
	d.mu.Unlock()
	return deadlineCtx{Context: ctx, deadline: at}, func() {
		d.mu.Lock()
		delete(d.calls, call)
		d.mu.Unlock()
	}
}

// arm sets the timer to fire at at; d.mu is held.
func (d *deadlines) arm(at time.Time) {
	d.at = at
	if d.timer == nil {
		d.timer = time.AfterFunc(time.Until(at), d.fire)
		return
	}
	d.timer.Reset(time.Until(at))
}

// fire ends the calls whose deadline passed and sets the timer for the
// next one.
func (d *deadlines) fire() {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	var next time.Time
	for call := range d.calls {
		if !now.Before(call.at) {
			call.cancel(context.DeadlineExceeded)
			delete(d.calls, call)
		} else if next.IsZero() || call.at.Before(next) {
			next = call.at
		}
	}
	d.at = time.Time{}
	if !next.IsZero() {
		d.arm(next)
	}
}

// deadlineCtx is a call's context with its client's deadline, which the
// server's deadlines end: its Err is then DeadlineExceeded, as that of a
// context.WithDeadline. A context derived from it ends then too, with
// Canceled as its Err and DeadlineExceeded as its context.Cause.
type deadlineCtx struct {
	context.Context // a context.WithCancelCause
	deadline        time.Time
}

func (c deadlineCtx) Deadline() (time.Time, bool) { return c.deadline, true }

func (c deadlineCtx) Err() error {
	err := c.Context.Err()
	if err != nil && errors.Is(context.Cause(c.Context), context.DeadlineExceeded) {
		return context.DeadlineExceeded
	}
	return err
}
