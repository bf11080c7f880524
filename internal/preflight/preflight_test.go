package preflight

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// fakeSystem has every feature but those named in missing (a feature's
// probe input: a syscall, a path, a family, a program, "cgroup2"), on the
// kernel release given.
type fakeSystem struct {
	kernel  string
	missing map[string]bool
}

func (f fakeSystem) HasSyscall(name string) bool    { return !f.missing[name] }
func (f fakeSystem) Exists(path string) bool        { return !f.missing[path] }
func (f fakeSystem) NetlinkFamily(name string) bool { return !f.missing["family:"+name] }
func (f fakeSystem) HasProgram(name string) bool    { return !f.missing[name] }
func (f fakeSystem) Kernel() string                 { return f.kernel }
func (f fakeSystem) Cgroup2() bool                  { return !f.missing["cgroup2"] }

func missing(names ...string) map[string]bool {
	m := map[string]bool{}
	for _, n := range names {
		m[n] = true
	}
	return m
}

func TestEverythingPresent(t *testing.T) {
	rep, err := Run(fakeSystem{kernel: "6.15.0"}, Options{Mounts: true})
	if err != nil {
		t.Fatal(err)
	}
	if m := rep.Missing(); len(m) != 0 {
		t.Fatalf("missing on a full system: %v", m)
	}
	if len(rep) != len(Checks(nil)) {
		t.Fatalf("a mounter ran %d checks of %d", len(rep), len(Checks(nil)))
	}
}

// TestEachCheckCanFail takes away one probe input at a time and expects
// exactly that feature missing, its message naming what it disables, and
// an error only for a fatal feature in a process that mounts.
func TestEachCheckCanFail(t *testing.T) {
	for _, tc := range []struct {
		feature  string
		sys      fakeSystem
		disables string
		fatal    bool
		also     []string // features missing with it (the same probe input)
	}{
		{"fsopen", fakeSystem{kernel: "6.15", missing: missing(SyscallFsopen)}, "every volume", true, nil},
		{"mount_setattr", fakeSystem{kernel: "6.15", missing: missing(SyscallMountSetattr)}, "every volume", true, nil},
		{"openat2", fakeSystem{kernel: "6.15", missing: missing(SyscallOpenat2)}, "every stage and publish", true, nil},
		{"move_mount_beneath", fakeSystem{kernel: "6.4.0-1-amd64"}, "FUSE volume's dead mount", false, []string{"open_tree_detached"}},
		{"open_tree_detached", fakeSystem{kernel: "6.14.2"}, "subPath of volumes in NRI mode", false, nil},
		{"nbd", fakeSystem{kernel: "6.15", missing: missing("family:nbd", "/sys/module/nbd")}, "nbd volumes", false, nil},
		{"iscsi_tcp", fakeSystem{kernel: "6.15", missing: missing("/sys/module/iscsi_tcp", "iscsiadm")}, "iscsi volumes", false, []string{"tool:iscsiadm"}},
		{"loop", fakeSystem{kernel: "6.15", missing: missing("/dev/loop-control")}, "loop volumes", false, nil},
		{"fuse", fakeSystem{kernel: "6.15", missing: missing("/dev/fuse")}, "fuse volumes", false, nil},
		{"cgroup2", fakeSystem{kernel: "6.15", missing: missing("cgroup2")}, "resource limits", false, nil},
		{"tool:blkid", fakeSystem{kernel: "6.15", missing: missing("blkid")}, "staging a filesystem volume", false, nil},
		{"tool:mkfs.ext4", fakeSystem{kernel: "6.15", missing: missing("mkfs.ext4")}, "ext4 volumes", false, nil},
		{"tool:e2fsck", fakeSystem{kernel: "6.15", missing: missing("e2fsck")}, "ext4 volumes", false, nil},
		{"tool:resize2fs", fakeSystem{kernel: "6.15", missing: missing("resize2fs")}, "expanding ext4", false, nil},
		{"tool:mkfs.xfs", fakeSystem{kernel: "6.15", missing: missing("mkfs.xfs")}, "xfs volumes", false, nil},
		{"tool:xfs_growfs", fakeSystem{kernel: "6.15", missing: missing("xfs_growfs")}, "expanding xfs", false, nil},
		{"tool:xfs_admin", fakeSystem{kernel: "6.15", missing: missing("xfs_admin")}, "xfs volumes", false, nil},
	} {
		t.Run(tc.feature, func(t *testing.T) {
			rep, err := Run(tc.sys, Options{Mounts: true})
			m := rep.Missing()
			var names []string
			for _, r := range m {
				names = append(names, r.Feature)
			}
			if want := append([]string{tc.feature}, tc.also...); !slices.Equal(names, want) {
				t.Fatalf("missing %v, want %v", names, want)
			}
			if msg := m[0].Message(); !strings.Contains(msg, tc.disables) || !strings.Contains(msg, tc.feature) {
				t.Errorf("message %q does not name %s and what it disables (%q)", msg, tc.feature, tc.disables)
			}
			if tc.fatal != (err != nil) {
				t.Errorf("fatal %v, error %v", tc.fatal, err)
			}
			if err != nil && (!errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), tc.disables)) {
				t.Errorf("error %v: want FailedPrecondition naming what is disabled", err)
			}
		})
	}
}

// TestNBDOldKernel: before 5.13 nbd has no backend identifiers, which the
// mounter needs; the module alone is not enough.
func TestNBDOldKernel(t *testing.T) {
	rep, _ := Run(fakeSystem{kernel: "5.10.0-28-amd64"}, Options{Mounts: true})
	got := rep.Available()
	if got["nbd_backend"] || !got["nbd"] {
		t.Fatalf("on 5.10 with nbd loaded: %v", got)
	}
	// One way of finding the module is enough.
	rep, _ = Run(fakeSystem{kernel: "6.1", missing: missing("family:nbd")}, Options{Mounts: true})
	if !rep.Available()["nbd"] {
		t.Fatal("nbd loaded (/sys/module/nbd) but no family answered: reported missing")
	}
}

// TestPluginNotFatal: a plugin beside a mounter checks the kernel only and
// never fails: the mounter is the one that cannot work.
func TestPluginNotFatal(t *testing.T) {
	rep, err := Run(fakeSystem{kernel: "5.4", missing: missing(SyscallMountSetattr, "/dev/fuse", "blkid")}, Options{})
	if err != nil {
		t.Fatalf("the plugin failed: %v", err)
	}
	got := rep.Available()
	if got["mount_setattr"] {
		t.Error("mount_setattr reported available")
	}
	for _, f := range []string{"fuse", "tool:blkid", "loop", "cgroup2"} {
		if _, ok := got[f]; ok {
			t.Errorf("the plugin checked %s, which only the mounter's view answers", f)
		}
	}
}

func TestExtraTools(t *testing.T) {
	tools := []Tool{{Name: "squashfuse", Package: "squashfuse", Disables: `fuse profile "squash"`}}
	rep, err := Run(fakeSystem{kernel: "6.15", missing: missing("squashfuse")}, Options{Mounts: true, Tools: tools})
	if err != nil {
		t.Fatal(err)
	}
	m := rep.Missing()
	if len(m) != 1 || !strings.Contains(m[0].Message(), `fuse profile "squash"`) {
		t.Fatalf("missing %v", m)
	}
}

func TestKernelAtLeast(t *testing.T) {
	for _, tc := range []struct {
		release      string
		major, minor int
		want         bool
	}{
		{"6.5.0-1-amd64", 6, 5, true},
		{"6.15.0", 6, 5, true},
		{"6.4.16", 6, 5, false},
		{"5.15.0-91-generic", 6, 5, false},
		{"7.0", 6, 15, true},
		{"garbage", 5, 6, false},
		{"", 5, 6, false},
	} {
		if got := kernelAtLeast(tc.release, tc.major, tc.minor); got != tc.want {
			t.Errorf("kernelAtLeast(%q, %d, %d) = %v", tc.release, tc.major, tc.minor, got)
		}
	}
}
