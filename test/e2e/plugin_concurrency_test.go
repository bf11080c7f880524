package e2e

import (
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/test/testutil"
)

// Concurrent stages: of different volumes all succeed (each formats its own
// image at the same time); of the same volume, each call gets OK or
// Aborted, and the volume ends up staged once, on one loop device.
func TestPluginConcurrentStage(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const n = 8
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("vol-conc-%d", i)
		e.create(ids[i], "ext4", 16*miB)
	}
	c := mountCap("ext4", rwo)

	// Different volumes at once.
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() { errs[i] = e.tryStage(id, c, nil, nil) })
	}
	wg.Wait()
	devices := map[string]string{}
	for i, id := range ids {
		if errs[i] != nil {
			t.Errorf("NodeStageVolume %s: %v", id, errs[i])
			continue
		}
		l := e.checkStagedLoop(id, e.image(id))
		if other, dup := devices[l.Name]; dup {
			t.Errorf("%s and %s share %s", id, other, l.Path())
		}
		devices[l.Name] = id
		e.notMounted(l)
	}
	if t.Failed() {
		t.FailNow()
	}
	for _, id := range ids {
		e.unstage(id)
		waitNoLoop(t, e.image(id))
	}

	// The same volume twice at once, for every volume at once.
	codesOf := make([][2]codes.Code, n)
	for i, id := range ids {
		for j := range 2 {
			wg.Go(func() { codesOf[i][j] = status.Code(e.tryStage(id, c, nil, nil)) })
		}
	}
	wg.Wait()
	aborted := 0
	for i, id := range ids {
		ok := 0
		for _, code := range codesOf[i] {
			switch code {
			case codes.OK:
				ok++
			case codes.Aborted:
				aborted++
			default:
				t.Errorf("concurrent NodeStageVolume %s: %v, want OK or Aborted", id, code)
			}
		}
		if ok == 0 {
			t.Errorf("concurrent NodeStageVolume %s: both calls failed (%v)", id, codesOf[i])
		}
		// The caller retries what was aborted; then it is staged once.
		e.stage(id, c, nil)
		e.checkStagedLoop(id, e.image(id))
	}
	t.Logf("%d of %d concurrent stages of the same volume were aborted", aborted, 2*n)
	for _, id := range ids {
		e.unstage(id)
		waitNoLoop(t, e.image(id))
		e.delete(id)
	}
}
