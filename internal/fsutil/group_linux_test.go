package fsutil

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/testenv"
)

// ApplyGroup changes group and modes below root only: a symlink in
// the volume (which a container controls) never leads it outside.
func TestApplyGroup(t *testing.T) {
	testenv.RequireRoot(t)
	root, outside := t.TempDir(), t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "d", "run.sh"), nil, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := ApplyGroup(root, 2000); err != nil {
		t.Fatal(err)
	}
	check := func(p string, mode uint32) {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Gid != 2000 || st.Mode&0o7777 != mode {
			t.Errorf("%s: gid %d mode %o, want gid 2000 mode %o", p, st.Gid, st.Mode&0o7777, mode)
		}
	}
	check(filepath.Join(root, "d"), 0o2770)
	check(filepath.Join(root, "d", "run.sh"), 0o770)
	var st unix.Stat_t
	if err := unix.Stat(secret, &st); err != nil || st.Gid == 2000 || st.Mode&0o7777 != 0o600 {
		t.Errorf("the symlink's target outside the volume changed: gid %d mode %o (%v)", st.Gid, st.Mode&0o7777, err)
	}
}
