//go:build linux

package mounter_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestSymlinkedTargets plants symlinks where a container (or a pod, in
// kubelet's directory) controls the path: in a mount point's parents, as
// the mount point itself, and inside a plan's target. Each points at a
// host-sensitive directory (the host's /etc, or a victim directory that
// stands for one). Targets are resolved through file descriptors without
// following a symlink, so every call is refused, and afterwards nothing is
// mounted in any namespace and the victims are as they were.
func TestSymlinkedTargets(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	victim := filepath.Join(dir, "victim")
	kubelet := filepath.Join(dir, "kubelet")
	ctr := filepath.Join(dir, "ctr")
	for _, d := range []string{victim, filepath.Join(kubelet, "pods"), filepath.Join(ctr, "real")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(victim, "passwd"), []byte("root:x:0:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	links := map[string]string{
		filepath.Join(ctr, "to-victim"):       victim,
		filepath.Join(ctr, "to-etc"):          "/etc",
		filepath.Join(ctr, "real", "sub"):     victim, // a plan's target "sub" below a real mount point
		filepath.Join(kubelet, "pods", "pod"): victim,
	}
	for link, to := range links {
		if err := os.Symlink(to, link); err != nil {
			t.Fatal(err)
		}
	}
	before := listDir(t, victim)
	pid := mountnstest.Namespace(t, "private")
	e := executor(t, kubelet)
	one := []plan.Mount{tmpfs("t", "")}
	tests := []struct {
		name   string
		mounts []plan.Mount
		c      plan.Consumer
	}{
		{"symlink in the mount point's parents", one, plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "to-victim", "data")}},
		{"the mount point is a symlink to /etc", one, plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "to-etc")}},
		{"a symlink to /etc in the parents", one, plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "to-etc", "ssl")}},
		{"a plan target that is a symlink", []plan.Mount{tmpfs("u", "sub")}, plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "real")}},
		{"publish through a symlink in the kubelet dir", one, plan.Consumer{MountPoint: filepath.Join(kubelet, "pods", "pod", "mount")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := e.Mount(context.Background(), tt.mounts, tt.c)
			if errdefs.Code(err) != codes.PermissionDenied {
				t.Fatalf("Mount = %v, want PermissionDenied", err)
			}
		})
	}
	for _, p := range []int{0, pid} {
		if n := countMounts(t, p, dir) + countMounts(t, p, "/etc"); n != 0 {
			t.Errorf("%d mounts left in pid %d's namespace", n, p)
		}
	}
	if after := listDir(t, victim); !slices.Equal(before, after) {
		t.Errorf("the victim changed: %v, was %v", after, before)
	}
	if fi, err := os.Lstat(filepath.Join(ctr, "real", "sub")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the planted link was replaced: %v %v", fi, err)
	}
	// The control: the same plan at a real path is performed.
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "real", "ok")}
	if err := e.Mount(context.Background(), one, c); err != nil {
		t.Fatal(err)
	}
	if err := e.UnmountAll(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	// Unmount through a symlink is refused too, and touches nothing.
	if err := e.UnmountAll(context.Background(), plan.Consumer{PID: pid, MountPoint: filepath.Join(ctr, "to-etc")}); errdefs.Code(err) != codes.PermissionDenied {
		t.Errorf("UnmountAll through a symlink = %v, want PermissionDenied", err)
	}
}

func listDir(t *testing.T, d string) []string {
	t.Helper()
	entries, err := os.ReadDir(d)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}
