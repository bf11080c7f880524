//go:build linux

package mountns_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// TestIsMountPoint: a tmpfs and a bind of a directory onto itself (same
// filesystem, same device: what a stat comparison misses) are mount
// points; a plain directory, a symlink to a mount point and the parent
// are not; a symlink in the directory part is followed; a missing path
// is fs.ErrNotExist.
func TestIsMountPoint(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	for _, d := range []string{"tmpfs", "bind", "plain"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	mount := func(src, target, fstype string, flags uintptr) {
		if err := unix.Mount(src, target, fstype, flags, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	}
	mount("mp-test", filepath.Join(dir, "tmpfs"), "tmpfs", 0)
	mount(filepath.Join(dir, "bind"), filepath.Join(dir, "bind"), "", unix.MS_BIND)
	for link, to := range map[string]string{"link": "tmpfs", "linkdir": "."} {
		if err := os.Symlink(to, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		path string
		want bool
	}{
		{"/", true},
		{dir + "/tmpfs", true},
		{dir + "/tmpfs/", true},
		{dir + "/bind", true},
		{dir + "/linkdir/tmpfs", true},
		{dir + "/plain", false},
		{dir + "/link", false},
		{dir, false},
	} {
		got, err := mountns.IsMountPoint(c.path)
		if err != nil || got != c.want {
			t.Errorf("IsMountPoint(%s) = %v, %v, want %v", c.path, got, err, c.want)
		}
	}
	for _, p := range []string{dir + "/missing", dir + "/missing/deeper"} {
		if got, err := mountns.IsMountPoint(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("IsMountPoint(%s) = %v, %v, want fs.ErrNotExist", p, got, err)
		}
	}
}
