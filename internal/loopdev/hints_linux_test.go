package loopdev

import (
	"context"
	"errors"
	"testing"

	"github.com/mountplan/mountplan/internal/testenv"
)

// drainHints forgets the numbers earlier tests detached, so that what a
// test hints is all Attach sees.
func drainHints() {
	for {
		if _, ok := takeHint(); !ok {
			return
		}
	}
}

// TestAttachReusesDetachedNumber proves Attach binds a number Detach just
// released, before asking GET_FREE: the highest of three devices is
// detached first, and GET_FREE would have returned the lowest.
func TestAttachReusesDetachedNumber(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testDir(t)
	drainHints()
	t.Cleanup(drainHints)
	var devs [3]*Device
	for i := range devs {
		devs[i] = mustAttach(t, sparseImage(t, dir, "held"+string(rune('a'+i))+".img", 16*mib), Options{})
	}
	low, high := devs[0], devs[2]
	if low.Number > high.Number {
		low, high = high, low
	}
	for _, d := range []*Device{high, low} {
		if err := d.Detach(); err != nil {
			t.Fatal(err)
		}
		waitGone(t, d)
	}
	first := mustAttach(t, sparseImage(t, dir, "first.img", 16*mib), Options{})
	if first.Number != high.Number {
		t.Errorf("first attach after the detaches got %s, want the first number released, %s", first.Path, high.Path)
	}
	second := mustAttach(t, sparseImage(t, dir, "second.img", 16*mib), Options{})
	if second.Number != low.Number {
		t.Errorf("second attach got %s, want the second number released, %s", second.Path, low.Path)
	}
}

// TestAttachStaleHints feeds Attach hints that are wrong: a number bound to
// another file and a number with no device. Attach must skip both, bind a
// free device, and leave the bound one as it was.
func TestAttachStaleHints(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testDir(t)
	drainHints()
	t.Cleanup(drainHints)
	busyImg := sparseImage(t, dir, "busy.img", 16*mib)
	busy := mustAttach(t, busyImg, Options{})
	hintFree(busy.Number)
	hintFree(1 << 20) // no such device: open fails
	img := sparseImage(t, dir, "new.img", 16*mib)
	d := mustAttach(t, img, Options{})
	if d.Number == busy.Number || !isBound(t, d, img) {
		t.Fatalf("attach got %s (bound to %q)", d.Path, sysfs(t, d, "loop/backing_file"))
	}
	if !isBound(t, busy, busyImg) {
		t.Fatalf("a stale hint changed %s's binding to %q", busy.Path, sysfs(t, busy, "loop/backing_file"))
	}
	if n, ok := takeHint(); ok {
		t.Fatalf("hint %d left after Attach tried them all", n)
	}
}

// TestAttachCancelledWithHints: a cancelled context stops Attach before it
// binds anything, hints or not.
func TestAttachCancelledWithHints(t *testing.T) {
	dir, _ := withOneHint(t)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	got, err := Attach(ctx, sparseImage(t, dir, "b.img", 16*mib), Options{})
	if !errors.Is(err, context.Canceled) {
		if got != nil {
			_ = got.Detach()
		}
		t.Fatalf("Attach with a cancelled context: %v, want context.Canceled", err)
	}
}

// TestAttachFailureKeepsHint: an attach that fails for its own reason (a
// block size the kernel refuses), not for a lost race, spends no hint: the
// number stays for the next attach.
func TestAttachFailureKeepsHint(t *testing.T) {
	dir, d := withOneHint(t)
	got, err := Attach(t.Context(), sparseImage(t, dir, "b.img", 16*mib), Options{BlockSize: 3000})
	if err == nil {
		_ = got.Detach()
		t.Fatal("Attach with a 3000 B block size succeeded, want the kernel's EINVAL")
	}
	if n, ok := takeHint(); !ok || n != d.Number {
		t.Fatalf("after a failed attach the hint is %d (%v), want %d kept", n, ok, d.Number)
	}
}

// withOneHint leaves exactly one hint: the number of a device it attached
// in a fresh test dir and detached (returned for its number).
func withOneHint(t *testing.T) (dir string, detached *Device) {
	t.Helper()
	testenv.RequireRoot(t)
	dir = testDir(t)
	drainHints()
	t.Cleanup(drainHints)
	d := mustAttach(t, sparseImage(t, dir, "a.img", 16*mib), Options{})
	if err := d.Detach(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
	return dir, d
}
