//go:build vmguest

package guest

import (
	"os"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon/cgroup"
	"github.com/mountplan/mountplan/internal/daemon/cgroup/cgrouptest"
)

// TestDaemonCgroupsEnforced runs the daemons' cgroup scenario on the
// guest's unified hierarchy, where memory and cpu are there to enable:
// the limits land in memory.max and cpu.max, a daemon that reads 256 MiB
// into one buffer under a 32 MiB limit is OOM-killed and counted, and
// everything is removed afterwards. (The host's hybrid hierarchy lacks
// those controllers.)
func TestDaemonCgroupsEnforced(t *testing.T) {
	if cgrouptest.FS() != "/sys/fs/cgroup" {
		t.Fatalf("the guest's init mounts cgroup2 at /sys/fs/cgroup; found %q", cgrouptest.FS())
	}
	// The guest's init is no cgroup manager: enable the controllers for
	// the root's children, as systemd or a runtime would.
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory +cpu"), 0); err != nil {
		t.Fatal(err)
	}
	base := cgrouptest.Dedicated(t, "mounter", "daemons")
	if mode := cgrouptest.Exercise(t, base); mode != cgroup.Enforced {
		t.Fatalf("mode %s in the guest, want %s", mode, cgroup.Enforced)
	}
}
