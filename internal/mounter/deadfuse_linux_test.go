//go:build linux

package mounter_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// startSquashfuse runs squashfuse in the foreground on mnt and waits for
// its mount; the returned command is killed by the test.
func startSquashfuse(t *testing.T, img, mnt string) *exec.Cmd {
	t.Helper()
	// No Pdeathsig: it fires when the forking thread exits, and the
	// executor's namespace threads exit on purpose.
	cmd := exec.Command("squashfuse", "-f", img, mnt)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) }) // runs first
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if ms, _ := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mnt)); len(ms) > 0 {
			return cmd
		}
	}
	t.Fatal("squashfuse did not mount within 10s")
	return nil
}

func fuseDevAt(t *testing.T, pid int, dir, p string) string {
	t.Helper()
	for _, m := range mountnstest.MountsUnder(t, pid, dir) {
		if m.Mountpoint == p {
			return fmt.Sprintf("%s %d:%d", m.FSType, m.Major, m.Minor)
		}
	}
	return ""
}

// TestUnmountReplacesDeadFuseBind is what healing a consumer needs: the
// daemon behind a bind died and a new one mounted the same source path, so
// the plan's source now has another device. Unmount must still remove the
// dead bind (it answers ENOTCONN), so that Mount can attach the new one;
// and it must never remove a FUSE bind that still answers.
func TestUnmountReplacesDeadFuseBind(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private") // before the FUSE mounts: no copies in it
	content := filepath.Join(dir, "content")
	if err := os.Mkdir(content, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(content, "f"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "img.sqfs")
	if out, err := exec.Command("mksquashfs", content, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
		t.Fatalf("mksquashfs: %v: %s", err, out)
	}
	src := filepath.Join(dir, "src")
	if err := os.Mkdir(src, 0o750); err != nil {
		t.Fatal(err)
	}
	first := startSquashfuse(t, img, src)
	mounts := []plan.Mount{{Type: "bind", Source: src, Options: opts()}}
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp"), Namespace: plan.Namespace{Inode: mountnstest.NamespaceInode(t, pid)}}
	e := executor(t, dir)
	if err := mounter.RecordMount(e, "fuse", src); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := e.Mount(ctx, mounts, c); err != nil {
		t.Fatal(err)
	}
	before := fuseDevAt(t, pid, dir, c.MountPoint)

	// The daemon dies; its mount in the host is lazily removed and a new
	// daemon mounts the same path.
	_ = first.Process.Kill()
	_ = first.Wait()
	if err := unix.Unmount(src, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	startSquashfuse(t, img, src)
	if err := mounter.RecordMount(e, "fuse", src); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(inNS(pid, filepath.Join(c.MountPoint, "f"))); err == nil {
		t.Fatalf("the dead bind still reads %q", b)
	}

	// What Host.Reattach does: Unmount, then Mount, of the same plan.
	if err := e.Unmount(ctx, mounts, c); err != nil {
		t.Fatalf("Unmount of the dead bind: %v", err)
	}
	if n := countMounts(t, pid, dir); n != 0 {
		t.Fatalf("after Unmount %d mounts remain in the consumer: %v", n, mountnstest.MountsUnder(t, pid, dir))
	}
	if err := e.Mount(ctx, mounts, c); err != nil {
		t.Fatal(err)
	}
	after := fuseDevAt(t, pid, dir, c.MountPoint)
	if after == "" || after == before {
		t.Fatalf("consumer's mount %q after re-attach, was %q", after, before)
	}
	if b, err := os.ReadFile(inNS(pid, filepath.Join(c.MountPoint, "f"))); err != nil || string(b) != "hello\n" {
		t.Fatalf("reading through the healed bind: %q, %v", b, err)
	}

	// A live FUSE bind under another plan's name is left alone.
	other := filepath.Join(dir, "other")
	if err := os.Mkdir(other, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := e.Unmount(ctx, []plan.Mount{{Type: "bind", Source: other, Options: opts()}}, c); err != nil {
		t.Fatal(err)
	}
	if got := fuseDevAt(t, pid, dir, c.MountPoint); got != after {
		t.Fatalf("Unmount of another plan removed a live FUSE bind: now %q", got)
	}
	if err := e.Unmount(ctx, mounts, c); err != nil {
		t.Fatal(err)
	}
}
