package blocking

import (
	"context"
	"errors"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// stuck is a call that returns v once release is closed: a syscall on a
// filesystem that answers only when its connection is aborted.
func stuck(release <-chan struct{}, runs *atomic.Int32, v int) func() (int, error) {
	return func() (int, error) {
		runs.Add(1)
		<-release
		return v, nil
	}
}

// settled waits for every call of the package to have returned.
func settled(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); len(slots) > 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d calls still under way", len(slots))
		}
	}
}

// TestEndedCtx: a call whose ctx has ended does not start.
func TestEndedCtx(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var runs atomic.Int32
	run := func() (int, error) { runs.Add(1); return 1, nil }
	if _, err := Call(ctx, "stat /x", run); !errors.Is(err, context.Canceled) {
		t.Errorf("Call = %v, want Canceled", err)
	}
	if _, err := Shared(ctx, "stat /x", "stat /x", run); !errors.Is(err, context.Canceled) {
		t.Errorf("Shared = %v, want Canceled", err)
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("%d calls ran", n)
	}
}

func TestCallAnswers(t *testing.T) {
	v, err := Call(context.Background(), "stat /x", func() (int, error) { return 7, nil })
	if v != 7 || err != nil {
		t.Fatalf("Call = %v, %v; want 7, nil", v, err)
	}
	boom := errors.New("boom")
	if _, err := Call(context.Background(), "stat /x", func() (int, error) { return 0, boom }); !errors.Is(err, boom) {
		t.Fatalf("Call = %v, want fn's error", err)
	}
	settled(t)
}

// TestCallEndsWithCtx: a call that does not return ends at ctx's end with
// ctx's error, and its slot is given back once the call returns.
func TestCallEndsWithCtx(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	_, err := Call(ctx, "stat /hung", stuck(release, &runs, 1))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Call of a call that never returns = %v, want DeadlineExceeded", err)
	}
	if len(slots) != 1 {
		t.Errorf("%d calls under way, want the one left behind", len(slots))
	}
	close(release)
	settled(t)
}

// TestLimit: past Limit calls under way a call is refused at once
// (ResourceExhausted) and does not run.
func TestLimit(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	for range Limit { // each caller gives up; its call stays under way
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		_, err := Call(ctx, "stat /hung", stuck(release, &runs, 1))
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Call = %v, want DeadlineExceeded", err)
		}
	}
	_, err := Call(context.Background(), "stat /hung", stuck(release, &runs, 1))
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("Call past the limit = %v, want ResourceExhausted", err)
	}
	if _, err := Shared(context.Background(), "k", "stat /hung", stuck(release, &runs, 1)); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("Shared past the limit = %v, want ResourceExhausted", err)
	}
	close(release)
	settled(t)
	if n := runs.Load(); n != Limit {
		t.Errorf("%d calls ran, want %d: a refused one must not", n, Limit)
	}
	if v, err := Call(context.Background(), "stat /x", func() (int, error) { return 1, nil }); v != 1 || err != nil {
		t.Errorf("Call once the calls returned = %v, %v", v, err)
	}
}

// TestShared: callers of the same key (and result type) while a call is
// under way share it, each until its own ctx ends; another key, or
// another result type, is a call of its own.
func TestShared(t *testing.T) {
	release := make(chan struct{})
	var runs atomic.Int32
	short, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	// The first caller gives up; the call stays under way.
	if _, err := Shared(short, "stat /a", "stat /a", stuck(release, &runs, 1)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shared = %v, want DeadlineExceeded", err)
	}
	var wg sync.WaitGroup
	got := make([]int, 4)
	for i := range got {
		wg.Go(func() {
			v, err := Shared(context.Background(), "stat /a", "stat /a", stuck(release, &runs, 2))
			if err != nil {
				t.Error(err)
			}
			got[i] = v
		})
	}
	other := make(chan string, 1)
	go func() {
		v, _ := Shared(context.Background(), "stat /a", "stat /a", func() (string, error) { return "own", nil })
		other <- v
	}()
	if v := <-other; v != "own" {
		t.Errorf("Shared of another result type = %q, want its own call's", v)
	}
	if v, _ := Shared(context.Background(), "stat /b", "stat /b", func() (int, error) { return 3, nil }); v != 3 {
		t.Errorf("Shared of another key = %d, want its own call's", v)
	}
	for joined("stat /a") != 1+len(got) || len(slots) != 1 {
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	for i, v := range got {
		if v != 1 {
			t.Errorf("caller %d got %d, want the first call's answer", i, v)
		}
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("%d calls ran for one key, want 1", n)
	}
	settled(t)
	if v, _ := Shared(context.Background(), "stat /a", "stat /a", func() (int, error) { return 4, nil }); v != 4 {
		t.Errorf("Shared once the call returned = %d, want a new call's", v)
	}
}

// joined is how many callers shared the int call of key.
func joined(key string) int {
	flightsMu.Lock()
	defer flightsMu.Unlock()
	if f, ok := flights[flightKey{reflect.TypeFor[int](), key}]; ok {
		return f.joined
	}
	return 0
}
