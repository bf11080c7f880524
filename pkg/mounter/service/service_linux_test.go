//go:build linux

package service_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestGRPCExecutor performs a plan in a namespace through the service, and
// checks that the executor's errors arrive with their sentinels.
func TestGRPCExecutor(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	client, _ := serve(t, &mounter.Executor{Policy: plan.Policy{Roots: []string{dir}}})
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	safe := []string{"nosuid", "nodev"}
	mounts := []plan.Mount{{Type: "tmpfs", Source: "grpc", Options: safe}, {Type: "tmpfs", Source: "grpc-sub", Target: "sub", Options: safe}}
	if err := client.Mount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 2 {
		t.Fatalf("%d mounts in the namespace, want 2", n)
	}
	if err := client.Mount(context.Background(), []plan.Mount{{Type: "tmpfs", Source: "x", Target: "../escape", Options: safe}}, c); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("target with .. = %v, want InvalidArgument", err)
	}
	gone := plan.Consumer{PID: 1<<22 + 1, MountPoint: c.MountPoint}
	if err := client.Mount(context.Background(), mounts, gone); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing pid = %v, want NotFound", err)
	}
	if err := client.Unmount(context.Background(), mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 0 {
		t.Fatalf("%d mounts left", n)
	}
}
