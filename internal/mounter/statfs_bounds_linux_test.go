package mounter_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/blocking/blockingtest"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestStatFSHungFuse: StatFS of a FUSE mount whose daemon does not answer
// ends at the caller's deadline with DeadlineExceeded rather than holding
// the call (and its connection to the mounter) for good.
func TestStatFSHungFuse(t *testing.T) {
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	blockingtest.HungFuse(t, dir)
	n := node(t, mounter.Options{})
	ns, err := mountns.IdentityOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := n.StatFS(ctx, plan.Consumer{PID: os.Getpid(), MountPoint: dir, Namespace: ns})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("StatFS of a FUSE mount that does not answer: %v, want DeadlineExceeded", err)
		}
		t.Logf("StatFS: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("StatFS of a FUSE mount that does not answer had not returned 5s after its caller's deadline")
	}
}
