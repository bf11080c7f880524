package loop

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/test/testutil"
)

// attachBehindBack binds img to a loop device and lets go of it, as an
// admin's losetup would: nothing of the plugin holds the device.
func attachBehindBack(t *testing.T, img string, ro bool) *loopdev.Device {
	t.Helper()
	d, err := loopdev.Attach(t.Context(), img, loopdev.Options{ReadOnly: ro})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Detach() })
	return d
}

func sparseFile(t *testing.T, path string) string {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 16<<20); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestRemoveDetachedImage: an image that a loop device reads, attached
// behind the plugin's back read-write or read-only, is refused with the
// device named and stays; a device whose release is under way is waited
// for; a missing image is no error.
func TestRemoveDetachedImage(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	testutil.NoLeaks(t, dir)
	ctx := context.Background()

	for _, ro := range []bool{false, true} {
		img := sparseFile(t, filepath.Join(dir, "attached.img"))
		d := attachBehindBack(t, img, ro)
		err := removeDetachedImage(ctx, img, 20*time.Millisecond)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), d.Path) {
			t.Fatalf("read-only %t: removeDetachedImage with %s attached = %v, want FailedPrecondition naming it", ro, d.Path, err)
		}
		if _, err := os.Stat(img); err != nil {
			t.Fatalf("image removed although refused: %v", err)
		}
		if err := d.Detach(); err != nil {
			t.Fatal(err)
		}
		if err := removeDetachedImage(ctx, img, 0); err != nil {
			t.Fatalf("after detach: %v", err)
		}
		if _, err := os.Stat(img); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("image still there after a removal that succeeded: %v", err)
		}
	}

	// A device that goes away within the wait: removed, no error.
	img := sparseFile(t, filepath.Join(dir, "releasing.img"))
	d := attachBehindBack(t, img, false)
	released := make(chan error, 1)
	go func() { time.Sleep(100 * time.Millisecond); released <- d.Detach() }()
	if err := removeDetachedImage(ctx, img, 10*time.Second); err != nil {
		t.Fatalf("a device released within the wait: %v", err)
	}
	if err := <-released; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image still there: %v", err)
	}

	if err := removeDetachedImage(ctx, filepath.Join(dir, "missing.img"), releaseWait); err != nil {
		t.Errorf("missing image: %v", err)
	}
}

// TestRemoveDetachedImageOverlay: overlayfs is no filesystem whose leases
// are trusted (a device attached through the lower path holds the lower
// inode); there the walk of the devices decides, as it always did.
func TestRemoveDetachedImageOverlay(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	testutil.NoLeaks(t, dir)
	lower, upper, work, merged := filepath.Join(dir, "lower"), filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
	for _, p := range []string{lower, upper, work, merged} {
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	sparseFile(t, filepath.Join(lower, "vol.img"))
	if err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(merged, 0) })
	img := filepath.Join(merged, "vol.img")
	d := attachBehindBack(t, img, true)
	if err := loopdev.WhileUnopened(img, func() error { return nil }); !errors.Is(err, errdefs.ErrUnimplemented) {
		t.Fatalf("WhileUnopened on overlayfs = %v, want ErrUnimplemented (leases there do not see the lower file's openers)", err)
	}
	if err := removeDetachedImage(context.Background(), img, releaseWait); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), d.Path) {
		t.Fatalf("overlay image with %s attached to its lower file = %v, want FailedPrecondition naming it", d.Path, err)
	}
	if err := d.Detach(); err != nil {
		t.Fatal(err)
	}
	if err := removeDetachedImage(context.Background(), img, releaseWait); err != nil {
		t.Fatalf("after detach: %v", err)
	}
}
