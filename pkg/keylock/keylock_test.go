package keylock

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/mountplan/mountplan/pkg/errdefs"
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
	if l.Held() != 0 {
		t.Fatalf("held = %d after release, want 0", l.Held())
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
