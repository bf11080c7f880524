// Package keylock holds per-key locks for operations that must not overlap
// on the same volume. A request on a busy key does not queue (TryLock): CSI
// wants it answered with Aborted so the CO retries later, and queuing would
// pile up kubelet's retries behind a slow device operation. Background work
// (a sweep, a reattach, a session login) waits instead (Lock), bounded by
// its context.
package keylock

import (
	"context"
	"fmt"
	"sync"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Locks is a set of named locks. Its zero value is ready to use. Entries
// exist only while held, so the map never grows with the number of volumes
// ever seen.
type Locks struct {
	mu   sync.Mutex
	held map[string]*entry
}

// entry is one held key. done is closed when it is released, which wakes
// every waiter; they then race for the key again under mu.
type entry struct {
	op   string
	done chan struct{}
}

// TryLock takes key for op, or returns an error wrapping errdefs.ErrAborted
// that names the operation in progress. The returned func releases the key.
func (l *Locks) TryLock(key, op string) (unlock func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if cur, busy := l.held[key]; busy {
		return nil, fmt.Errorf("%s is busy with %s: %w", key, cur.op, errdefs.ErrAborted)
	}
	return l.take(key, op), nil
}

// Lock takes key for op, waiting while another operation holds it. It
// returns an error wrapping ctx.Err(), naming the holder, when ctx ends
// first. The returned func releases the key.
func (l *Locks) Lock(ctx context.Context, key, op string) (unlock func(), err error) {
	for {
		l.mu.Lock()
		cur, busy := l.held[key]
		if !busy {
			unlock = l.take(key, op)
			l.mu.Unlock()
			return unlock, nil
		}
		l.mu.Unlock()
		select {
		case <-cur.done:
		case <-ctx.Done():
			return nil, fmt.Errorf("%s: %s waited for %s: %w", key, op, cur.op, ctx.Err())
		}
	}
}

// take records key as held by op. Called with mu held and key free.
func (l *Locks) take(key, op string) func() {
	if l.held == nil {
		l.held = map[string]*entry{}
	}
	e := &entry{op: op, done: make(chan struct{})}
	l.held[key] = e
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			delete(l.held, key)
			l.mu.Unlock()
			close(e.done)
		})
	}
}
