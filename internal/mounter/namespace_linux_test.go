//go:build linux

package mounter_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestUnmountAfterConsumerExited: a container's first process (the PID the
// consumer was recorded by) exits while others live on. Its namespace and
// mounts live on too, so Unmount and UnmountAll must reach them through a
// process still there, not report the namespace gone.
func TestUnmountAfterConsumerExited(t *testing.T) {
	mountnstest.RequireRoot(t)
	ctx := context.Background()
	for _, tt := range []struct {
		name    string
		unmount func(*mounter.Local, []plan.Mount, plan.Consumer) error
	}{
		{"Unmount", func(e *mounter.Local, m []plan.Mount, c plan.Consumer) error { return e.Unmount(ctx, m, c) }},
		{"UnmountAll", func(e *mounter.Local, _ []plan.Mount, c plan.Consumer) error { return e.UnmountAll(ctx, c) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := mountnstest.Scratch(t)
			s := mountnstest.NewSharedNamespace(t, "private")
			id, err := mountns.IdentityOf(s.First)
			if err != nil {
				t.Fatal(err)
			}
			if id.ID == 0 {
				testenv.Missing(t, "a kernel with the NS_GET_MNTNS_ID ioctl: without it the namespace is not searched for")
			}
			mounts := []plan.Mount{tmpfs("outer", ""), tmpfs("inner", "sub")}
			c := plan.Consumer{PID: s.First, MountPoint: filepath.Join(dir, "mp"), Namespace: plan.Namespace{Inode: id.Inode, ID: id.ID}}
			e := executor(t, dir)
			if err := e.Mount(ctx, mounts, c); err != nil {
				t.Fatal(err)
			}
			if n := countMounts(t, s.Second, dir); n != 2 {
				t.Fatalf("%d mounts in the namespace, want 2", n)
			}

			s.KillFirst()
			if err := tt.unmount(e, mounts, c); err != nil {
				t.Fatalf("%s after the consumer's process exited: %v", tt.name, err)
			}
			if in := mountnstest.MountsUnder(t, s.Second, dir); len(in) != 0 {
				t.Fatalf("%s returned but %s is still mounted in the consumer's namespace (seen by pid %d)", tt.name, in[0].Mountpoint, s.Second)
			}

			// Mount too finds the namespace; a PID reused by a process
			// elsewhere (here: the test's own) does not redirect it.
			c.PID = os.Getpid()
			if err := e.Mount(ctx, mounts, c); err != nil {
				t.Fatalf("Mount through another process: %v", err)
			}
			if n, host := countMounts(t, s.Second, dir), countMounts(t, 0, dir); n != 2 || host != 0 {
				t.Fatalf("Mount through another process: %d mounts in the namespace (want 2), %d in the test's (want 0)", n, host)
			}
			if err := tt.unmount(e, mounts, c); err != nil {
				t.Fatalf("%s with a reused PID: %v", tt.name, err)
			}
			if n := countMounts(t, s.Second, dir); n != 0 {
				t.Fatalf("%s with a reused PID left %d mounts in the consumer's namespace", tt.name, n)
			}

			// With the last process gone the kernel dropped the mounts:
			// nothing to do, and nothing done elsewhere.
			if err := e.Mount(ctx, mounts, c); err != nil {
				t.Fatal(err)
			}
			s.KillSecond(t)
			if err := tt.unmount(e, mounts, c); err != nil {
				t.Fatalf("%s of a namespace that is gone: %v", tt.name, err)
			}
		})
	}
}
