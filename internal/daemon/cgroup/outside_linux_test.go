package cgroup_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/daemon/cgroup"
	"github.com/mountplan/mountplan/internal/daemon/cgroup/cgrouptest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestOutsideCgroupConcurrentVolumes: volumes' leaves prepared and
// removed at once, as the mounter does with its per-volume locks. The
// teardown of one volume removes the levels above the leaves when they
// are empty (RemoveEmptyLevels); without the Manager's lock that could
// happen between another volume's check of them and its mkdir (ENOENT),
// and the levels' mode was written while another Prepare read it (run
// with -race). A cgroup v2 directory of the test's own stands for the
// host's cgroup file system, so the v2 layout is exercised on a hybrid
// host too.
func TestOutsideCgroupConcurrentVolumes(t *testing.T) {
	testenv.RequireRoot(t)
	testutil.NoLeaks(t)
	hostFS := cgrouptest.Dedicated(t) // nothing may be left below it
	m, err := cgroup.SetupOutside(hostFS, "instance")
	if err != nil {
		t.Fatal(err)
	}
	if !m.Outside() {
		t.Fatal("SetupOutside's manager says it is not outside")
	}
	const volumes, rounds = 4, 50
	var wg sync.WaitGroup
	errs := make(chan error, volumes)
	for v := range volumes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("vol-%d", v)
			for r := range rounds {
				if _, err := m.Prepare(name, cgroup.Limits{}); err != nil {
					errs <- fmt.Errorf("round %d: Prepare(%s): %w", r, name, err)
					return
				}
				_ = m.Mode()
				if err := m.Remove(context.Background(), name, time.Second); err != nil {
					errs <- fmt.Errorf("round %d: Remove(%s): %w", r, name, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if left := cgrouptest.Below(hostFS); len(left) > 0 {
		t.Errorf("left below the host's cgroups after every volume's Remove: %v", left)
	}
}

// TestOutsideCgroupPidsMax: a daemon's leaf outside the mounter's
// container is bounded in tasks (pids.max), by default and by its
// profile, since the pod's pids limit no longer holds it. Laid out in the
// host's own hierarchies (v1 on a hybrid host) under an instance of the
// test's own, removed at the end.
func TestOutsideCgroupPidsMax(t *testing.T) {
	testenv.RequireRoot(t)
	testutil.NoLeaks(t)
	instance := fmt.Sprintf("mountplan-test-%d", time.Now().UnixNano())
	m, err := cgroup.SetupOutside(cgroup.DefaultFS, instance)
	if err != nil {
		testenv.Missing(t, "cgroups the test can lay out below %s: %v", cgroup.DefaultFS, err)
	}
	t.Cleanup(func() {
		m.RemoveEmptyLevels()
		// Every directory of the instance, in every hierarchy.
		matches, _ := filepath.Glob(filepath.Join(cgroup.DefaultFS, "*", cgroup.OutsideDir, instance))
		more, _ := filepath.Glob(filepath.Join(cgroup.DefaultFS, cgroup.OutsideDir, instance))
		for _, d := range append(matches, more...) {
			t.Errorf("left behind: %s (%v)", d, cgrouptest.Below(d))
			_ = cgrouptest.RemoveTree(d)
		}
	})
	for name, c := range map[string]struct {
		l    cgroup.Limits
		want string
	}{
		"vol-default": {cgroup.Limits{}, "512"},
		"vol-profile": {cgroup.Limits{Pids: 64}, "64"},
	} {
		leaf, err := m.Prepare(name, c.l)
		if err != nil {
			t.Fatalf("Prepare(%s): %v", name, err)
		}
		var found []string
		for _, dir := range append(slices.Clone(leaf.V1), leaf.Unified) {
			if dir == "" {
				continue
			}
			b, err := os.ReadFile(filepath.Join(dir, "pids.max"))
			if err != nil {
				continue // not the pids hierarchy
			}
			found = append(found, dir)
			if got := strings.TrimSpace(string(b)); got != c.want {
				t.Errorf("%s: pids.max %q, want %q", dir, got, c.want)
			}
		}
		if len(found) == 0 {
			t.Errorf("%s: no leaf with pids.max among %q and %q", name, leaf.V1, leaf.Unified)
		}
		if err := m.Remove(context.Background(), name, time.Second); err != nil {
			t.Errorf("Remove(%s): %v", name, err)
		}
	}
}

// TestOutsideCgroupSetupFailureLeavesNothing: a SetupOutside that fails halfway
// (the second of the v1 hierarchies it needs is not mounted below hostFS)
// removes the levels it made in the first. hostFS is given with a
// trailing slash: cleaned, it still finds the first hierarchy below it,
// so the failure is the second one's.
func TestOutsideCgroupSetupFailureLeavesNothing(t *testing.T) {
	testenv.RequireRoot(t)
	testutil.NoLeaks(t)
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	// The v1 hierarchies SetupOutside lays out, in its order.
	var wanted []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 || f[0] == "0" {
			continue
		}
		names := strings.Split(f[1], ",")
		if f[2] != "/" || slices.Contains(names, "memory") || slices.Contains(names, "cpu") || slices.Contains(names, "pids") {
			wanted = append(wanted, f[1])
		}
	}
	if len(wanted) < 2 {
		testenv.Missing(t, "two cgroup v1 hierarchies for the daemons (a v1 or hybrid host); have %q", wanted)
	}
	hostFS := t.TempDir()
	first := filepath.Join(hostFS, "first")
	if err := os.Mkdir(first, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("cgroup", first, "cgroup", 0, wanted[0]); err != nil {
		t.Fatalf("mounting the %s hierarchy: %v", wanted[0], err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(first, 0); err != nil {
			t.Errorf("unmount %s: %v", first, err)
		}
	})
	shared := filepath.Join(first, cgroup.OutsideDir)
	_, serr := os.Stat(shared)
	sharedBefore := serr == nil
	instance := fmt.Sprintf("mountplan-test-%d", time.Now().UnixNano())
	m, err := cgroup.SetupOutside(hostFS+"/", instance)
	if err == nil {
		m.RemoveEmptyLevels()
		t.Fatalf("SetupOutside with the %s hierarchy missing succeeded", wanted[1])
	}
	if !strings.Contains(err.Error(), wanted[1]) {
		t.Errorf("SetupOutside failed for another reason than the missing %s hierarchy: %v", wanted[1], err)
	}
	if _, err := os.Stat(filepath.Join(shared, instance)); err == nil {
		t.Errorf("a failed SetupOutside left %s", filepath.Join(shared, instance))
		_ = unix.Rmdir(filepath.Join(shared, instance))
	}
	if _, err := os.Stat(shared); err == nil && !sharedBefore {
		t.Errorf("a failed SetupOutside left %s, which it made", shared)
		_ = unix.Rmdir(shared)
	}
}
