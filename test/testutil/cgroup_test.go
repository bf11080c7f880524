package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/testenv"
)

// The cluster test removes what its containers left in the CRI's cgroup
// namespace and nothing that was there before it: on a hybrid host that
// includes the v2 hierarchy at /sys/fs/cgroup/unified (CI once found
// container cgroups left only there).
func TestRemoveCgroupTreeExceptSparesWhatWasThere(t *testing.T) {
	testenv.RequireRoot(t)
	name := fmt.Sprintf("mountplan-cgtest-%d", os.Getpid())
	tops, err := cgroupMounts()
	if err != nil || len(tops) == 0 {
		t.Fatalf("no cgroup hierarchy mounted (%v)", err)
	}
	t.Cleanup(func() {
		if err := RemoveCgroupTree(name); err != nil {
			t.Errorf("leak: %v", err)
		}
		for _, top := range tops {
			if _, err := os.Stat(filepath.Join(top, name)); err == nil {
				t.Errorf("leak: cgroup %s", filepath.Join(top, name))
			}
		}
	})
	for _, top := range tops {
		if err := os.MkdirAll(filepath.Join(top, name, "host"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	before, err := CgroupTree(name)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 2*len(tops) {
		t.Fatalf("CgroupTree found %d directories, want %d (two in each of %v)", len(before), 2*len(tops), tops)
	}
	for _, top := range tops {
		if err := os.MkdirAll(filepath.Join(top, name, "ctr", "child"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveCgroupTreeExcept(name, before); err != nil {
		t.Fatal(err)
	}
	for _, top := range tops {
		if _, err := os.Stat(filepath.Join(top, name, "host")); err != nil {
			t.Errorf("a cgroup that was there before was removed: %v", err)
		}
		if _, err := os.Stat(filepath.Join(top, name, "ctr")); !os.IsNotExist(err) {
			t.Errorf("cgroup %s left (err %v)", filepath.Join(top, name, "ctr"), err)
		}
	}
}
