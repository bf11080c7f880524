package cgroup_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

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
