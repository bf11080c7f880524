package blocking_test

import (
	"context"
	"errors"
	"io/fs"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/blocking"
	"github.com/mountplan/mountplan/internal/blocking/blockingtest"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
)

// TestStatHungFuse: a stat of a path on a FUSE filesystem whose daemon
// never answers ends at ctx's end, Unavailable and naming the path, and
// once the connection is aborted the call left behind returns.
func TestStatHungFuse(t *testing.T) {
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	hung := blockingtest.HungFuse(t, dir)
	p := filepath.Join(dir, "dev")
	for range 3 { // the runtime asking again: one call under way
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		done := make(chan error, 1)
		go func() { _, err := blocking.Stat(ctx, p); done <- err }()
		select {
		case err := <-done:
			if !errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Stat of a path that never answers = %v, want Unavailable", err)
			}
			t.Logf("Stat: %v", err)
		case <-time.After(5 * time.Second):
			t.Fatal("Stat of a path that never answers had not returned 5s after its deadline")
		}
		cancel()
	}
	if err := hung.Abort(); err != nil {
		t.Fatal(err)
	}
	// The filesystem gone, the path is the directory's own name below
	// the scratch dir again: it does not exist.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		_, err := blocking.Stat(context.Background(), p)
		if errors.Is(err, fs.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Stat once the connection was aborted = %v, want ENOENT", err)
		}
	}
}
