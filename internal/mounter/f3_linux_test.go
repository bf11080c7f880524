//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestF3RecursiveBind (issue 33, F3, the recipe confirmed from outside): a
// bind of the state dir's p with rec, where p/x has an outside directory
// bound on it, used to reach the consumer with that directory's file
// readable, and an ApplyGroup of it gave the outside files to the pod's
// group. Both are refused now; a plain bind and ApplyGroup of p still
// work and leave what is mounted below p behind, untouched.
func TestF3RecursiveBind(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	state, kubelet, outside := filepath.Join(dir, "state"), filepath.Join(dir, "kubelet"), filepath.Join(dir, "outside")
	p := filepath.Join(state, "p")
	mkdirs(t, filepath.Join(p, "x"), kubelet, outside)
	writeFile(t, filepath.Join(outside, "marker"), "host secret\n")
	writeFile(t, filepath.Join(p, "own"), "volume\n")
	n := node(t, mounter.Options{StateDir: state, KubeletDir: kubelet})
	bindMount(t, outside, filepath.Join(p, "x"))
	marker := filepath.Join(outside, "marker")
	var before unix.Stat_t
	if err := unix.Stat(marker, &before); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	target := filepath.Join(kubelet, "target")
	c := plan.Consumer{MountPoint: target}
	rec := []plan.Mount{{Type: plan.TypeBind, Source: p, Options: opts("rec")}}
	err := n.Mount(ctx, rec, c)
	if err == nil {
		defer undo(t, n, c)
	}
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Mount of a rec bind of %s = %v, want InvalidArgument", p, err)
	}
	if b, err := os.ReadFile(filepath.Join(target, "x", "marker")); err == nil {
		t.Errorf("the consumer reads the outside directory's file through the bind: %q", b)
	}
	if err := n.ApplyGroup(ctx, rec, 2000); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("ApplyGroup of a rec bind of %s = %v, want InvalidArgument", p, err)
	}
	// A plain bind's ApplyGroup gives p's own files to the group and
	// stops at the mount on p/x.
	plain := []plan.Mount{{Type: plan.TypeBind, Source: p, Options: opts()}}
	if err := n.ApplyGroup(ctx, plain, 2000); err != nil {
		t.Fatalf("ApplyGroup of a plain bind of %s: %v", p, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(marker, &st); err != nil || st.Gid != before.Gid || st.Mode != before.Mode {
		t.Errorf("ApplyGroup changed the outside file: gid %d mode %o, was gid %d mode %o (%v)", st.Gid, st.Mode&0o7777, before.Gid, before.Mode&0o7777, err)
	}
	if err := unix.Stat(filepath.Join(p, "own"), &st); err != nil || st.Gid != 2000 {
		t.Errorf("ApplyGroup left the volume's own file at gid %d (%v), want 2000", st.Gid, err)
	}
}
