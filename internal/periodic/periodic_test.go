package periodic

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

// bound is how long a test waits for a loop that should return (or call)
// at once: a broken loop fails its test in seconds, not at the test
// binary's timeout.
const bound = 10 * time.Second

// start runs loop in a goroutine and returns a channel closed when it
// returns.
func start(loop func()) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		loop()
	}()
	return done
}

// await fails the test unless ch yields within bound.
func await[T any](t *testing.T, ch <-chan T, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(bound):
		t.Fatalf("%s: not within %v", what, bound)
	}
}

func TestEveryStopsWhenFnSaysSo(t *testing.T) {
	n := 0
	await(t, start(func() {
		Every(t.Context(), time.Millisecond, func(context.Context) bool {
			n++
			return n < 3
		})
	}), "Every returns once fn says false")
	if n != 3 {
		t.Fatalf("fn called %d times, want 3", n)
	}
}

func TestEveryStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	calls := make(chan struct{}, 1)
	done := start(func() {
		Every(ctx, time.Millisecond, func(context.Context) bool {
			select {
			case calls <- struct{}{}:
			default:
			}
			return true
		})
	})
	await(t, calls, "Every calls fn at an interval of 1ms")
	cancel()
	await(t, done, "Every returns once its context ends")
}

func TestEveryWaitsAnInterval(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	called := false
	await(t, start(func() {
		Every(ctx, time.Hour, func(context.Context) bool {
			called = true
			return false
		})
	}), "Every returns at once when its context has ended")
	if called {
		t.Fatal("fn called before the first interval")
	}
}

func TestRetryUntilSuccess(t *testing.T) {
	var waits []time.Duration
	last := time.Now()
	n := 0
	ok := Retry(t.Context(), time.Millisecond, time.Hour, func(context.Context) error {
		now := time.Now()
		waits = append(waits, now.Sub(last))
		last = now
		n++
		if n < 4 {
			return errors.New("not yet")
		}
		return nil
	})
	if !ok || n != 4 {
		t.Fatalf("Retry reported %v after %d calls, want true after 4", ok, n)
	}
	// Each wait at least doubles: 1, 2, 4, 8 ms at the least.
	for i, w := range waits {
		if min := time.Millisecond << i; w < min {
			t.Errorf("wait %d was %v, want at least %v", i, w, min)
		}
	}
}

func TestRetryGivesUpAtLimit(t *testing.T) {
	n := 0
	ok := Retry(t.Context(), time.Millisecond, 4*time.Millisecond, func(context.Context) error {
		n++
		return errors.New("never")
	})
	if ok || n != 3 { // after 1, 2 and 4 ms; 8 ms is past the limit
		t.Fatalf("Retry reported %v after %d calls, want false after 3", ok, n)
	}
}

func TestRetryStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if Retry(ctx, time.Millisecond, time.Hour, func(context.Context) error {
		t.Fatal("fn called after ctx ended")
		return nil
	}) {
		t.Fatal("Retry reported success without a call")
	}
}

func TestBackoff(t *testing.T) {
	next := Backoff(time.Second, 10*time.Second).DelayFunc()
	var got []time.Duration
	for range 7 {
		got = append(got, next())
	}
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second, 10 * time.Second, 10 * time.Second}
	if !slices.Equal(got, want) {
		t.Fatalf("waits %v, want %v", got, want)
	}
}
