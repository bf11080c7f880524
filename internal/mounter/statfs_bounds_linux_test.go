package mounter_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// hungFuse mounts at dir a FUSE filesystem whose daemon never answers:
// the mounter's view of a hung sshfs. Cleanup aborts the connection (the
// device's last descriptor closes), which ends every call blocked on it,
// and unmounts it.
func hungFuse(t *testing.T, dir string) {
	t.Helper()
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := unix.Mount("mountplan-hung", dir, "fuse.hung", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		dev.Close()
		t.Fatalf("mount a FUSE filesystem at %s: %v", dir, err)
	}
	t.Cleanup(func() {
		dev.Close()
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
}

// TestStatFSHungFuse: StatFS of a FUSE mount whose daemon does not answer
// ends at the caller's deadline with DeadlineExceeded rather than holding
// the call (and its connection to the mounter) for good.
func TestStatFSHungFuse(t *testing.T) {
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	hungFuse(t, dir)
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
