package loop

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/loopdev"
)

// TestImageHealth: a staged volume's image that is removed, or replaced by
// another file, is abnormal with its reason; the very file is normal, and
// so is a state that names no backing file.
func TestImageHealth(t *testing.T) {
	dir := t.TempDir()
	image := filepath.Join(dir, "image")
	if err := os.WriteFile(image, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	var fi unix.Stat_t
	if err := unix.Stat(image, &fi); err != nil {
		t.Fatal(err)
	}
	st := State{Device: "/dev/loop7", Identity: loopdev.Identity{Major: 7, Minor: 7, BackingDev: uint64(fi.Dev), BackingIno: fi.Ino}} //nolint:unconvert // Dev is uint32 on some architectures
	if h := imageHealth(image, st); h.Abnormal {
		t.Fatalf("the attached file: %+v, want normal", h)
	}
	if h := imageHealth(image, State{}); h.Abnormal {
		t.Fatalf("a state without identity: %+v, want normal", h)
	}
	other := filepath.Join(dir, "other")
	if err := os.WriteFile(other, []byte("other"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(image, filepath.Join(dir, "kept")); err != nil { // keeps the inode from being reused
		t.Fatal(err)
	}
	if err := os.Rename(other, image); err != nil {
		t.Fatal(err)
	}
	if h := imageHealth(image, st); !h.Abnormal || !h.DataLoss || h.Reason != "ImageReplaced" {
		t.Fatalf("a replaced image: %+v, want ImageReplaced with data loss", h)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if h := imageHealth(image, st); !h.Abnormal || !h.DataLoss || h.Reason != "ImageGone" {
		t.Fatalf("a removed image: %+v, want ImageGone with data loss", h)
	}
}
