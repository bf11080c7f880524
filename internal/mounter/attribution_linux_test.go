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

// records lists the mounter's records of consumer namespaces and mount
// points.
func records(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, sub := range []string{"namespaces", "mountpoints"} {
		names, err := filepath.Glob(filepath.Join(dir, sub, "*.json"))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, names...)
	}
	return out
}

// TestAttributionRecordsGo: what the mounter records of a container's
// namespace goes with the container: at once when the runtime says it
// stopped (Forget, by the NRI hook), or at the next Prune once no process
// is left in it. Nothing is left behind in the records dir.
func TestAttributionRecordsGo(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	recs := filepath.Join(dir, "records")
	n := node(t, mounter.Options{StateDir: filepath.Join(dir, "state"), RecordsDir: recs, Attributed: true})
	ctx := context.Background()
	tmpfs := []plan.Mount{{Type: "tmpfs", Source: "mp-forget", Options: []string{"nosuid", "nodev"}}}

	stopped := mountnstest.Container(t)
	if _, err := n.Attribute(ctx, stopped, mounter.ByRuntime, "ctr-1"); err != nil {
		t.Fatal(err)
	}
	if err := n.Mount(ctx, tmpfs, plan.Consumer{PID: stopped, MountPoint: "/tmp/vol"}); err != nil {
		t.Fatal(err)
	}
	if got := records(t, recs); len(got) != 2 {
		t.Fatalf("records after a mount in a named container: %v, want its namespace and mount point", got)
	}
	if err := n.Forget(ctx, "ctr-1"); err != nil {
		t.Fatal(err)
	}
	if got := records(t, recs); len(got) != 0 {
		t.Errorf("records after the container's stop: %v, want none", got)
	}

	// A namespace whose last process exits without a word: Prune.
	gone, kill := exitingNamespace(t)
	if _, err := n.Attribute(ctx, gone, mounter.ByAdmin, ""); err != nil {
		t.Fatal(err)
	}
	if err := n.Mount(ctx, tmpfs, plan.Consumer{PID: gone, MountPoint: "/tmp/vol"}); err != nil {
		t.Fatal(err)
	}
	n.Prune(ctx)
	if got := records(t, recs); len(got) != 2 {
		t.Fatalf("Prune dropped the records of a live namespace: %v", got)
	}
	kill()
	n.Prune(ctx)
	if got := records(t, recs); len(got) != 0 {
		t.Errorf("records after the namespace's last process exited and a prune: %v, want none", got)
	}
}

// exitingNamespace is a Container whose process the returned func kills
// and reaps: its namespace is gone after it returns.
func exitingNamespace(t *testing.T) (int, func()) {
	t.Helper()
	pid := mountnstest.Container(t)
	return pid, func() {
		p, err := os.FindProcess(pid)
		if err != nil {
			t.Fatal(err)
		}
		_ = p.Kill()
		_, _ = p.Wait()
	}
}

// TestTornRecords: a record a machine crash tore (written without fsync:
// it describes a boot's namespaces and mounts only, gone with it) is as
// good as absent in the next boot, never an error that stops a Mount there
// (make test-vm's hard reset left one, and the next publish failed). In
// the boot it describes it vouches for nothing: the mount stays.
func TestTornRecords(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	recs := filepath.Join(dir, "records")
	kubelet := filepath.Join(dir, "kubelet")
	if err := os.MkdirAll(kubelet, 0o755); err != nil {
		t.Fatal(err)
	}
	n := node(t, mounter.Options{StateDir: filepath.Join(dir, "state"), KubeletDir: kubelet, RecordsDir: recs, Attributed: true})
	ctx := context.Background()
	tmpfs := []plan.Mount{{Type: "tmpfs", Source: "mp-torn", Options: []string{"nosuid", "nodev"}}}
	c := plan.Consumer{MountPoint: filepath.Join(kubelet, "pods", "p", "mount")}
	if err := n.Mount(ctx, tmpfs, c); err != nil {
		t.Fatal(err)
	}
	// What a crash mid-write leaves: the record's first bytes.
	for _, p := range records(t, recs) {
		if err := os.WriteFile(p, []byte(`{"namespace":{"nsIn`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.Unmount(ctx, tmpfs, c); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("Unmount of a tmpfs whose record is torn = %v, want PermissionDenied (nothing vouches for it)", err)
	}
	// The reboot: the mount is gone, the torn record stays.
	if err := unix.Unmount(c.MountPoint, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := n.Mount(ctx, tmpfs, c); err != nil {
		t.Fatalf("Mount where a torn record lies: %v", err)
	}
	if err := n.Unmount(ctx, tmpfs, c); err != nil {
		t.Errorf("Unmount of that mount: %v", err)
	}
}
