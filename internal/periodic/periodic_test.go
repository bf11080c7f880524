package periodic

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestEveryStopsWhenFnSaysSo(t *testing.T) {
	n := 0
	Every(t.Context(), time.Millisecond, func(context.Context) bool {
		n++
		return n < 3
	})
	if n != 3 {
		t.Fatalf("fn called %d times, want 3", n)
	}
}

func TestEveryStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	calls := make(chan struct{}, 100)
	go func() {
		defer close(done)
		Every(ctx, time.Millisecond, func(context.Context) bool {
			calls <- struct{}{}
			return true
		})
	}()
	<-calls // it runs
	cancel()
	<-done // and it returns once ctx ends
}

func TestEveryWaitsAnInterval(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	Every(ctx, time.Hour, func(context.Context) bool {
		t.Fatal("fn called before the first interval")
		return false
	})
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
