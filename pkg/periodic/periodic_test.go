package periodic

import (
	"context"
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
