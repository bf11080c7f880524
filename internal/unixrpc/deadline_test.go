package unixrpc

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestDeadlines: calls in flight with deadlines in any order each end at
// their own, none before; one that is done before its deadline is not
// ended; the timer is set for the earliest deadline in flight.
func TestDeadlines(t *testing.T) {
	var d deadlines
	start := time.Now()
	type call struct {
		after time.Duration
		ctx   context.Context
		done  func()
		ended chan time.Duration
	}
	calls := []*call{{after: 120 * time.Millisecond}, {after: 40 * time.Millisecond}, {after: 80 * time.Millisecond}, {after: 60 * time.Millisecond}}
	for _, c := range calls {
		c.ctx, c.done = d.start(context.Background(), start.Add(c.after))
		defer c.done()
		c.ended = make(chan time.Duration, 1)
		context.AfterFunc(c.ctx, func() { c.ended <- time.Since(start) })
	}
	if got, _ := calls[0].ctx.Deadline(); !got.Equal(start.Add(calls[0].after)) {
		t.Errorf("Deadline %v, want %v", got, start.Add(calls[0].after))
	}
	calls[3].done() // over before its deadline
	for _, c := range calls[:3] {
		if at := <-c.ended; at < c.after {
			t.Errorf("the call with a deadline %v later ended after %v", c.after, at)
		}
		if err := c.ctx.Err(); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Err %v, want DeadlineExceeded", err)
		}
		derived, cancel := context.WithCancel(c.ctx)
		if !errors.Is(context.Cause(derived), context.DeadlineExceeded) {
			t.Errorf("a derived context's cause: %v, want DeadlineExceeded", context.Cause(derived))
		}
		cancel()
	}
	time.Sleep(30 * time.Millisecond)
	if err := calls[3].ctx.Err(); err != nil {
		t.Errorf("a call done before its deadline was ended: %v", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.calls) != 0 || !d.at.IsZero() {
		t.Errorf("%d calls left, timer at %v; want none", len(d.calls), d.at)
	}
	// A deadline already past ends the call at once.
	ctx, done := d.start(context.Background(), time.Now().Add(-time.Second))
	defer done()
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Errorf("a past deadline: Err %v, want DeadlineExceeded", ctx.Err())
	}
}
