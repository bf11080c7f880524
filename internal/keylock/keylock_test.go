package keylock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestTryLockConflictIsAborted(t *testing.T) {
	var l Locks
	unlock, err := l.TryLock("vol-1", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryLock("vol-1", "NodePublishVolume"); !errors.Is(err, errdefs.ErrAborted) {
		t.Fatalf("second lock: got %v, want ErrAborted", err)
	}
	other, err := l.TryLock("vol-2", "NodeStageVolume")
	if err != nil {
		t.Fatalf("another key must not be blocked: %v", err)
	}
	other()
	unlock()
	unlock() // a second release is harmless
	if held(&l) != 0 {
		t.Fatalf("held = %d after release, want 0", held(&l))
	}
	again, err := l.TryLock("vol-1", "NodeUnstageVolume")
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	again()
}

func TestTryLockExclusiveUnderRace(t *testing.T) {
	var l Locks
	var inside, maxInside atomic.Int32
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock, err := l.TryLock("k", "op")
			if err != nil {
				return
			}
			n := inside.Add(1)
			for {
				m := maxInside.Load()
				if n <= m || maxInside.CompareAndSwap(m, n) {
					break
				}
			}
			inside.Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if maxInside.Load() != 1 {
		t.Fatalf("%d holders at once, want 1", maxInside.Load())
	}
}

func TestLockWaitsForRelease(t *testing.T) {
	var l Locks
	unlock, err := l.TryLock("vol-1", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		u, err := l.Lock(context.Background(), "vol-1", "reattach")
		if err == nil {
			u()
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Lock returned (%v) while the key was held", err)
	case <-time.After(50 * time.Millisecond):
	}
	if _, err := l.TryLock("vol-1", "NodePublishVolume"); !errors.Is(err, errdefs.ErrAborted) {
		t.Fatalf("TryLock while held: got %v, want ErrAborted", err)
	}
	unlock()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("Lock after release: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Lock did not return after the key was released")
	}
	if held(&l) != 0 {
		t.Fatalf("held = %d after every release, want 0", held(&l))
	}
}

func TestLockHonoursContext(t *testing.T) {
	var l Locks
	unlock, err := l.TryLock("vol-1", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan error, 1)
	go func() {
		_, err := l.Lock(ctx, "vol-1", "sweep")
		got <- err
	}()
	cancel()
	select {
	case err := <-got:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Lock with a cancelled context: got %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Lock ignored its cancelled context")
	}
	if held(&l) != 1 {
		t.Fatalf("held = %d, want 1 (the first holder only)", held(&l))
	}
}

func TestLockExclusiveAndNoGrowth(t *testing.T) {
	var l Locks
	var inside, maxInside atomic.Int32
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("k%d", i%4)
			unlock, err := l.Lock(context.Background(), key, "op")
			if err != nil {
				t.Error(err)
				return
			}
			defer unlock()
			if key != "k0" {
				return
			}
			n := inside.Add(1)
			for {
				m := maxInside.Load()
				if n <= m || maxInside.CompareAndSwap(m, n) {
					break
				}
			}
			time.Sleep(time.Millisecond)
			inside.Add(-1)
		}()
	}
	wg.Wait()
	if maxInside.Load() != 1 {
		t.Fatalf("%d holders of k0 at once, want 1", maxInside.Load())
	}
	if held(&l) != 0 {
		t.Fatalf("held = %d after every release, want 0", held(&l))
	}
}

// held is how many keys l holds now.
func held(l *Locks) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.held)
}
