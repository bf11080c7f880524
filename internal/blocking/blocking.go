// Package blocking runs a call that may never return so that its caller
// need not wait for it: a system call on a path of a filesystem that does
// not answer (a FUSE daemon, an NFS or sshfs server gone) sleeps in the
// kernel until the connection is aborted, and no context reaches it.
//
// Call and Shared run the call in a goroutine of its own and return at
// the caller's deadline; a call left behind keeps its goroutine, and the
// OS thread under it, until the kernel returns. At most Limit such
// goroutines run at once in the process (Go dies past 10,000 threads);
// past that a call is refused at once with errdefs.ErrResourceExhausted.
package blocking

import (
	"context"
	"fmt"
	"reflect"
	"sync"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Limit is how many calls of this package run at once in the process.
const Limit = 64

// slots holds a token per call under way: the process's, as its threads
// are.
var slots = make(chan struct{}, Limit)

// Call runs fn, which may block in the kernel on a filesystem that does
// not answer, and returns its result or, when ctx ends first, an error
// that wraps ctx's: fn is then left to finish on its own. what names the
// call and its path, for the error. Past Limit such calls at once it is
// errdefs.ErrResourceExhausted, and fn does not run; nor does it once ctx
// has ended.
func Call[T any](ctx context.Context, what string, fn func() (T, error)) (T, error) {
	if err := ctx.Err(); err != nil {
		var zero T
		return zero, fmt.Errorf("%s: %w", what, err)
	}
	f, err := start(what, fn, nil)
	if err != nil {
		var zero T
		return zero, err
	}
	return wait[T](ctx, what, f)
}

// Shared is Call for a call that key names completely (the operation and
// its path): while one with the same key and result type is under way,
// another waits for that one's result, with its own ctx, instead of
// running fn again. A caller that asks again and again about a path that
// never answers (kubelet retrying a container whose creation failed)
// thus holds one goroutine, not one per try.
func Shared[T any](ctx context.Context, key, what string, fn func() (T, error)) (T, error) {
	if err := ctx.Err(); err != nil {
		var zero T
		return zero, fmt.Errorf("%s: %w", what, err)
	}
	k := flightKey{reflect.TypeFor[T](), key}
	flightsMu.Lock()
	f, ok := flights[k]
	if !ok {
		var err error
		f, err = start(what, fn, func() {
			flightsMu.Lock()
			delete(flights, k)
			flightsMu.Unlock()
		})
		if err != nil {
			flightsMu.Unlock()
			var zero T
			return zero, err
		}
		flights[k] = f
	}
	f.joined++
	flightsMu.Unlock()
	return wait[T](ctx, what, f)
}

// flight is one call under way; v and err are set before done is closed.
type flight struct {
	done   chan struct{}
	v      any
	err    error
	joined int // callers that share it (Shared), under flightsMu
}

type flightKey struct {
	typ reflect.Type
	key string
}

var (
	flightsMu sync.Mutex
	flights   = map[flightKey]*flight{}
)

// start takes a slot and runs fn in a goroutine that gives it back when fn
// returns, after calling ended (if any).
func start[T any](what string, fn func() (T, error), ended func()) (*flight, error) {
	select {
	case slots <- struct{}{}:
	default:
		return nil, fmt.Errorf("%s: %d calls wait on filesystems already, the limit: %w", what, Limit, errdefs.ErrResourceExhausted)
	}
	f := &flight{done: make(chan struct{})}
	go func() {
		defer func() { <-slots }()
		v, err := fn()
		if ended != nil {
			ended()
		}
		f.v, f.err = v, err
		close(f.done)
	}()
	return f, nil
}

// wait returns f's result, or ctx's error when ctx ends first.
func wait[T any](ctx context.Context, what string, f *flight) (T, error) {
	select {
	case <-f.done:
		v, _ := f.v.(T)
		return v, f.err
	case <-ctx.Done():
		select {
		case <-f.done: // both: the answer wins
			v, _ := f.v.(T)
			return v, f.err
		default:
		}
		var zero T
		return zero, fmt.Errorf("%s: the filesystem did not answer: %w", what, ctx.Err())
	}
}
