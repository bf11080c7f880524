//go:build linux

package mounter_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// TestSharedGroupOfAgreesWithMountTable: what statmount(2) says of the
// mount a path lies on is what the mount table says: the peer group of a
// shared mount, 0 once it is private.
func TestSharedGroupOfAgreesWithMountTable(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	p := sharedTmpfs(t, filepath.Join(dir, "m"))
	if err := os.Mkdir(filepath.Join(p, "sub"), 0o750); err != nil {
		t.Fatal(err)
	}
	tableGroup := func() int {
		t.Helper()
		infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
		if err != nil || len(infos) != 1 {
			t.Fatalf("mount table entry of %s: %v, %d entries", p, err, len(infos))
		}
		for _, f := range strings.Fields(infos[0].Optional) {
			if v, ok := strings.CutPrefix(f, "shared:"); ok {
				group, err := strconv.Atoi(v)
				if err != nil {
					t.Fatal(err)
				}
				return group
			}
		}
		return 0
	}
	sub, err := os.Open(filepath.Join(p, "sub"))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	want := tableGroup()
	got, err := mounter.SharedGroupOf(sub)
	if err != nil {
		t.Fatal(err)
	}
	if want == 0 || got != want {
		t.Fatalf("shared mount: statmount says peer group %d, the mount table %d", got, want)
	}

	if err := unix.Mount("", p, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	if got, err := mounter.SharedGroupOf(sub); err != nil || got != 0 || tableGroup() != 0 {
		t.Fatalf("private mount: statmount says peer group %d (%v), the mount table %d; want 0", got, err, tableGroup())
	}
}
