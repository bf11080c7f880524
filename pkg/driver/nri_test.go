package driver

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestParseNRIAndMountGroup(t *testing.T) {
	for _, tc := range []struct {
		vctx    map[string]string
		want    bool
		wantErr bool
	}{{nil, false, false}, {map[string]string{"nri": "true"}, true, false}, {map[string]string{"nri": "false"}, false, false},
		{map[string]string{"nri": "1"}, false, true}, {map[string]string{"nri": "yes"}, false, true}} {
		got, err := parseNRI(tc.vctx)
		if got != tc.want || (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
			t.Errorf("parseNRI(%v) = %v, %v", tc.vctx, got, err)
		}
	}
	vctx := map[string]string{"nri": "true", "image": "/x"}
	if got := withoutDriverAttributes(vctx); len(got) != 1 || got["image"] != "/x" || len(vctx) != 2 {
		t.Errorf("withoutDriverAttributes: %v (input now %v)", got, vctx)
	}
	for s, want := range map[string]bool{"": false, "2000": true} {
		if _, set, err := parseMountGroup(s); set != want || err != nil {
			t.Errorf("parseMountGroup(%q) = %v, %v", s, set, err)
		}
	}
	for _, s := range []string{"wheel", "-1", "4294967296"} {
		if _, _, err := parseMountGroup(s); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("parseMountGroup(%q): %v, want InvalidArgument", s, err)
		}
	}
}

// applyMountGroup changes group and modes below root only: a symlink in
// the volume (which a container controls) never leads it outside.
func TestApplyMountGroup(t *testing.T) {
	testutil.RequireRoot(t)
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
	if err := applyMountGroup(root, 2000); err != nil {
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
