package fsutil

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/testenv"
)

// TestApplyGroupStopsAtMounts (issue 33, F3): a volume given to a pod's
// fsGroup may hold a mount below its root (another volume's secrets, a
// host directory bound there): the walk leaves it and everything in it
// as it was, and still gives the volume's own files to the group.
func TestApplyGroupStopsAtMounts(t *testing.T) {
	testenv.RequireRoot(t)
	root, outside := t.TempDir(), t.TempDir()
	hostFile := filepath.Join(outside, "key")
	if err := os.WriteFile(hostFile, []byte("host\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	own := filepath.Join(root, "own")
	if err := os.WriteFile(own, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"bound", "tmp"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	// A host directory bound below the volume, and a tmpfs of its own.
	bound, tmp := filepath.Join(root, "bound"), filepath.Join(root, "tmp")
	if err := unix.Mount(outside, bound, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(bound, unix.MNT_DETACH) })
	if err := unix.Mount("f3-planted", tmp, "tmpfs", 0, "mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(tmp, unix.MNT_DETACH) })
	inTmp := filepath.Join(tmp, "secret")
	if err := os.WriteFile(inTmp, []byte("s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	planted := []string{hostFile, outside, inTmp, tmp}
	before := map[string]unix.Stat_t{}
	for _, p := range planted {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		before[p] = st
	}
	if err := ApplyGroup(root, 2000); err != nil {
		t.Fatal(err)
	}
	for _, p := range planted {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		if b := before[p]; st.Gid != b.Gid || st.Mode != b.Mode {
			t.Errorf("%s on a mount below the volume changed: gid %d mode %o, was gid %d mode %o", p, st.Gid, st.Mode&0o7777, b.Gid, b.Mode&0o7777)
		}
	}
	var st unix.Stat_t
	if err := unix.Lstat(own, &st); err != nil || st.Gid != 2000 || st.Mode&0o7777 != 0o660 {
		t.Errorf("the volume's own file: gid %d mode %o (%v), want gid 2000 mode 660", st.Gid, st.Mode&0o7777, err)
	}
}
