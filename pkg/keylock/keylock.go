// Package keylock holds per-key locks for operations that must not overlap
// on the same volume. A second operation on a busy key does not queue: CSI
// wants it answered with Aborted so the CO retries later, and queuing would
// pile up kubelet's retries behind a slow device operation.
package keylock

import (
	"fmt"
	"sync"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

// Locks is a set of named locks. Its zero value is ready to use. Entries
// exist only while held, so the map never grows with the number of volumes
// ever seen.
type Locks struct {
	mu   sync.Mutex
	held map[string]string // key → operation holding it
}

// TryLock takes key for op, or returns an error wrapping errdefs.ErrAborted
// that names the operation in progress. The returned func releases the key.
func (l *Locks) TryLock(key, op string) (unlock func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held == nil {
		l.held = map[string]string{}
	}
	if cur, busy := l.held[key]; busy {
		return nil, fmt.Errorf("%s is busy with %s: %w", key, cur, errdefs.ErrAborted)
	}
	l.held[key] = op
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			delete(l.held, key)
			l.mu.Unlock()
		})
	}, nil
}

// Held reports how many keys are held now (for tests and metrics).
func (l *Locks) Held() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.held)
}
