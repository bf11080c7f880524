package cgroup_test

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/daemon/cgroup"
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

// TestSetupOnV1: where /sys/fs/cgroup is no cgroup2 (a v1 or hybrid
// host), the mounter's own cgroup is refused, saying so. On a unified
// host the call would lay out this test's own cgroup, and is not made.
func TestSetupOnV1(t *testing.T) {
	var st unix.Statfs_t
	if err := unix.Statfs(cgroup.DefaultFS, &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		t.Skip("a unified host: Setup(\"\") would take this test's own cgroup")
	}
	m, err := cgroup.Setup("")
	if err == nil || m != nil || !strings.Contains(err.Error(), "v1 or hybrid") {
		t.Fatalf("Setup on a v1 host = %v, %v", m, err)
	}
}
