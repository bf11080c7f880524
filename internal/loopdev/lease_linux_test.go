package loopdev

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/testenv"
)

// TestWhileUnopened: the lease is refused while anyone else has the file
// open (another open file in this process, a bound loop device read-write
// or read-only, a device marked for autoclear that a mount still holds)
// and granted once nobody has; fn runs only under the lease.
func TestWhileUnopened(t *testing.T) {
	testenv.RequireRoot(t)
	for _, fs := range []string{"disk", "tmpfs"} {
		t.Run(fs, func(t *testing.T) {
			dir := testDir(t)
			if fs == "tmpfs" {
				dir = mountFS(t, "tmpfs")
			}
			img := sparseImage(t, dir, "img", 16<<20)
			ran := 0
			count := func() error { ran++; return nil }
			refused := func(what string) {
				t.Helper()
				err := WhileUnopened(img, count)
				if !errors.Is(err, ErrOpenElsewhere) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Fatalf("%s: WhileUnopened = %v, want ErrOpenElsewhere", what, err)
				}
			}
			granted := func(what string) {
				t.Helper()
				before := ran
				if err := WhileUnopened(img, count); err != nil || ran != before+1 {
					t.Fatalf("%s: WhileUnopened = %v (fn ran %d times), want nil and one run", what, err, ran-before)
				}
			}
			granted("unopened")

			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			refused("open for reading in this process")
			f.Close()
			granted("closed again")

			for _, ro := range []bool{false, true} {
				d := mustAttach(t, img, Options{ReadOnly: ro})
				refused("bound")
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				refused("bound, no fd held (as losetup leaves it)")
				if err := d.Detach(); err != nil {
					t.Fatal(err)
				}
				waitGone(t, d)
				granted("detached")
			}

			// A mounted device that was asked to detach stays bound until
			// the last close: the lease must see it as long as it exists.
			testenv.RequireCommands(t, "mkfs.ext4")
			run(t, "mkfs.ext4", "-q", "-F", img)
			d := mustAttach(t, img, Options{Autoclear: true})
			mnt := filepath.Join(t.TempDir(), "mnt")
			if err := os.Mkdir(mnt, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount(d.Path, mnt, "ext4", 0, ""); err != nil {
				t.Fatal(err)
			}
			if err := d.Detach(); err != nil {
				t.Fatal(err)
			}
			refused("released by its owner but still mounted")
			if err := unix.Unmount(mnt, 0); err != nil {
				t.Fatal(err)
			}
			waitGone(t, d)
			granted("unmounted")
		})
	}
	if err := WhileUnopened(filepath.Join(t.TempDir(), "missing"), func() error { return nil }); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing file: %v, want ErrNotFound", err)
	}
}
