//go:build vmguest

package guest

import (
	"os"
	"os/exec"
	"strings"
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

// TestMounterDaemonCgroup runs the mounter's own TestDaemonCgroup (its
// test binary, which test/vm puts at /mounter.test) where memory and cpu
// are enabled: a FUSE daemon's profile limits in its leaf, and a daemon
// that allocates past them dies OOMKilled and is restarted in the same
// leaf. CI=true: a missing prerequisite fails it rather than skip.
func TestMounterDaemonCgroup(t *testing.T) {
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory +cpu"), 0); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/mounter.test", "-test.run", "^TestDaemonCgroup$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "CI=true")
	cmd.Dir = "/tmp"
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("the mounter's TestDaemonCgroup: %v", err)
	}
	for _, want := range []string{"--- PASS: TestDaemonCgroup", "OOMKilled"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("its output lacks %q", want)
		}
	}
}
