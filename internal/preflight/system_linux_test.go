package preflight

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/mountplan/mountplan/internal/testenv"
)

// TestRealPreflight runs the mounter's preflight on this machine and
// compares each answer with what the machine shows by other means: the
// release in /proc, the file system type of /sys/fs/cgroup in
// /proc/mounts, the device nodes, $PATH.
func TestRealPreflight(t *testing.T) {
	testenv.RequireRoot(t)
	rel, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		t.Fatal(err)
	}
	release := strings.TrimSpace(string(rel))
	if got := (Real{}).Kernel(); got != release {
		t.Fatalf("kernel %q, /proc says %q", got, release)
	}
	if !kernelAtLeast(release, 5, 12) {
		testenv.Missing(t, "Linux 5.12 or later (this is %s)", release)
	}
	rep, err := Run(Real{}, Options{Mounts: true})
	if err != nil {
		t.Fatalf("the mounter's preflight fails on %s: %v", release, err)
	}
	logger, _ := ktesting.NewTestContext(t)
	rep.Log(logger, release)
	got := rep.Available()
	want := map[string]bool{
		"fsopen": true, "mount_setattr": true, "openat2": true,
		"move_mount_beneath": kernelAtLeast(release, 6, 5),
		"open_tree_detached": kernelAtLeast(release, 6, 15),
		"loop":               exists("/dev/loop-control"),
		"fuse":               exists("/dev/fuse"),
		"cgroup2":            mountType("/sys/fs/cgroup") == "cgroup2",
	}
	if exists("/sys/module/nbd") {
		want["nbd"] = true
	}
	for _, tool := range Tools() {
		_, err := exec.LookPath(tool.Name)
		want["tool:"+tool.Name] = err == nil
	}
	for f, w := range want {
		if got[f] != w {
			t.Errorf("%s: preflight says available=%v, the machine shows %v", f, got[f], w)
		}
	}
	for _, r := range rep.Missing() {
		t.Logf("missing here: %s", r.Message())
	}
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// mountType is the file system type of the last mount at dir in /proc/mounts.
func mountType(dir string) string {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return ""
	}
	typ := ""
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[1] == dir {
			typ = f[2]
		}
	}
	return typ
}
