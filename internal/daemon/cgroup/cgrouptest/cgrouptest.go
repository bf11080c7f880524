//go:build linux

// Package cgrouptest gives a root test a cgroup v2 directory of its own,
// removed with everything below it afterwards, and runs the daemons'
// cgroup scenario in it: on the host's hierarchy (which, on a hybrid
// host, lacks the memory and cpu controllers: the leaves only account)
// and in test/vm's guest (a unified hierarchy: limits and the OOM killer).
package cgrouptest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/testenv"
)

// FS is the mount point of the cgroup v2 hierarchy ("" when none is
// mounted): /sys/fs/cgroup on a unified host, /sys/fs/cgroup/unified on
// a hybrid one.
func FS() string {
	infos, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil || len(infos) == 0 {
		return ""
	}
	slices.SortFunc(infos, func(a, b *mountinfo.Info) int { return len(a.Mountpoint) - len(b.Mountpoint) })
	return infos[0].Mountpoint
}

// Dedicated makes <cgroup2>/mountplan-test-<random> and, at cleanup,
// kills whatever is left in it, removes it with everything below, and
// fails t if anything was left there by the code under test (a process
// or a directory below it, other than those listed in expected, which
// the test itself made).
func Dedicated(t testing.TB, expected ...string) string {
	t.Helper()
	root := FS()
	if root == "" {
		testenv.Missing(t, "a cgroup v2 hierarchy (cgroup2 mounted anywhere)")
	}
	dir, err := os.MkdirTemp(root, "mountplan-test-")
	if err != nil {
		t.Fatalf("a test cgroup below %s: %v", root, err)
	}
	t.Cleanup(func() {
		left := Below(dir)
		left = slices.DeleteFunc(left, func(p string) bool { return slices.Contains(expected, p) })
		if len(left) > 0 {
			t.Errorf("cgroups left below %s: %v", dir, left)
		}
		if Populated(dir) {
			t.Errorf("processes left in the test cgroup %s", dir)
		}
		if err := RemoveTree(dir); err != nil {
			t.Errorf("removing the test cgroup: %v", err)
		}
	})
	return dir
}

// Below lists the cgroups below dir, relative to it.
func Below(dir string) []string {
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && p != dir {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return nil
	})
	return out
}

// RemoveTree kills every process in dir's subtree and removes it,
// deepest first.
func RemoveTree(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	_ = wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		return !Populated(dir), nil
	})
	dirs := append([]string{""}, Below(dir)...)
	var errs []error
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(filepath.Join(dir, dirs[i])); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("rmdir %s: %w", filepath.Join(dir, dirs[i]), err))
		}
	}
	return errors.Join(errs...)
}

// Populated says whether a process is in dir's subtree.
func Populated(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	return err == nil && strings.Contains(string(b), "populated 1")
}

// HasControllers says whether memory and cpu are available to dir.
func HasControllers(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	f := strings.Fields(string(b))
	return err == nil && slices.Contains(f, "memory") && slices.Contains(f, "cpu")
}

// Of is pid's cgroup v2 path below fsRoot ("" when it cannot be read).
func Of(fsRoot string, pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(fsRoot, p)
		}
	}
	return ""
}

// Read is the trimmed content of dir's interface file name.
func Read(t testing.TB, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}
