package cgroup_test

import (
	"testing"

	"github.com/mountplan/mountplan/internal/daemon/cgroup/cgrouptest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestDaemonCgroups runs the scenario in a cgroup of the test's own below
// whatever cgroup v2 hierarchy the host has: on a hybrid host its leaves
// only account (the limits and the OOM kill are proven in test/vm).
func TestDaemonCgroups(t *testing.T) {
	testenv.RequireRoot(t)
	testutil.NoLeaks(t)
	base := cgrouptest.Dedicated(t, "mounter", "daemons")
	mode := cgrouptest.Exercise(t, base)
	t.Logf("mode here: %s", mode)
}
