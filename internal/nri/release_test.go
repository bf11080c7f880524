package nri

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// fakeVolumes records releases. A release waits for gate when it is set
// (a volume busy with other work), and the first abort releases of each
// volume answer Aborted.
type fakeVolumes struct {
	mu       sync.Mutex
	released []Claim
	tries    map[string]int
	gate     chan struct{}
	abort    int
}

func (f *fakeVolumes) Prepare(context.Context, Claim) (string, []plan.Mount, error) {
	return "", nil, nil
}

func (f *fakeVolumes) Release(ctx context.Context, c Claim) error {
	if f.gate != nil {
		select {
		case <-f.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.tries == nil {
		f.tries = map[string]int{}
	}
	f.tries[c.VolumeID]++
	if f.tries[c.VolumeID] <= f.abort {
		return errdefs.ErrAborted
	}
	f.released = append(f.released, c)
	return nil
}

func (f *fakeVolumes) Sync(context.Context, []string) error { return nil }

func (f *fakeVolumes) releases() []Claim {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Claim(nil), f.released...)
}

func annotated(t *testing.T, id string, claims ...Claim) *nriapi.Container {
	t.Helper()
	rec, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	return &nriapi.Container{Id: id, Annotations: map[string]string{Annotation: string(rec)}}
}

// A release never holds the runtime: StopContainer and RemoveContainer
// answer while the plugin has not yet answered the release (a volume
// busy with other work), which then completes on its own. Under load a
// release that waited inside the event overran the runtime's plugin
// timeout, and the runtime dropped the hook.
func TestReleaseDoesNotHoldTheRuntime(t *testing.T) {
	f := &fakeVolumes{gate: make(chan struct{})}
	h := NewHook(f, nil, "", "")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond) // the runtime's deadline
	defer cancel()
	if _, err := h.StopContainer(ctx, nil, annotated(t, "c1", Claim{VolumeID: "v1", Destination: "/data"})); err != nil {
		t.Fatal(err)
	}
	if err := h.RemoveContainer(ctx, nil, annotated(t, "c2", Claim{VolumeID: "v2", Destination: "/data"})); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatal("the events waited for the releases past the runtime's deadline")
	}
	<-ctx.Done() // the events' contexts end: the releases go on
	if got := f.releases(); len(got) != 0 {
		t.Fatalf("released %+v before the plugin answered", got)
	}
	close(f.gate)
	h.wait()
	if got := f.releases(); len(got) != 2 {
		t.Errorf("released %+v, want v1 of c1 and v2 of c2", got)
	}
}

// A release the plugin refuses for now (Aborted: the volume's lock is
// held) is asked again until it is done.
func TestReleaseRetriesAborted(t *testing.T) {
	f := &fakeVolumes{abort: 2}
	h := NewHook(f, nil, "", "")
	h.releaseLater(context.Background(), "c1", []Claim{{VolumeID: "v1"}, {VolumeID: ""}, {VolumeID: "v2"}})
	h.wait()
	got := f.releases()
	if len(got) != 2 || got[0].VolumeID != "v1" || got[1].VolumeID != "v2" || got[0].ContainerID != "c1" {
		t.Fatalf("released %+v, want v1 and v2 of c1", got)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.tries["v1"] != 3 || f.tries["v2"] != 3 || f.tries[""] != 0 {
		t.Errorf("tries %v, want 3 per volume (two Aborted) and none for the claim with no volume", f.tries)
	}
}

// errVolumes answers every release with err.
type errVolumes struct {
	fakeVolumes
	err   error
	calls int
	mu    sync.Mutex
}

func (e *errVolumes) Release(context.Context, Claim) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.calls++
	return e.err
}

// An answer another try would not change (NotFound: the plugin has no
// such claim) is not asked again.
func TestReleaseDoesNotRetryFinalAnswers(t *testing.T) {
	e := &errVolumes{err: errors.Join(errors.New("no such volume"), errdefs.ErrNotFound)}
	h := NewHook(e, nil, "", "")
	h.releaseLater(context.Background(), "c1", []Claim{{VolumeID: "v1"}})
	h.wait()
	if e.calls != 1 {
		t.Errorf("%d releases for a NotFound, want 1", e.calls)
	}
}

// The hook's bound follows the runtime's request timeout unless it is
// set: containerd's default 2s gives 1.5s, a raised one more room.
func TestTimeoutFollowsTheRuntime(t *testing.T) {
	h := NewHook(&fakeVolumes{}, nil, "", "")
	if got := h.timeout(); got != DefaultTimeout {
		t.Errorf("before registration: %v, want %v", got, DefaultTimeout)
	}
	h.runtimeSays(2 * time.Second)
	if got := h.timeout(); got != 1500*time.Millisecond {
		t.Errorf("runtime's 2s: %v, want 1.5s", got)
	}
	h.runtimeSays(8 * time.Second)
	if got := h.timeout(); got != 6*time.Second {
		t.Errorf("runtime's 8s: %v, want 6s", got)
	}
	h.Timeout = 300 * time.Millisecond
	if got := h.timeout(); got != h.Timeout {
		t.Errorf("set to %v: %v", h.Timeout, got)
	}
}

// Once Run has ended (close), an event the runtime still had in flight
// starts no background work.
func TestNoBackgroundWorkAfterClose(t *testing.T) {
	f := &fakeVolumes{}
	h := NewHook(f, nil, "", "")
	h.close()
	if _, err := h.StopContainer(context.Background(), nil, annotated(t, "c1", Claim{VolumeID: "v1"})); err != nil {
		t.Fatal(err)
	}
	h.wait()
	if got := f.releases(); len(got) != 0 {
		t.Errorf("released %+v after close", got)
	}
}
