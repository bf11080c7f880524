//go:build linux

package mountns_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

const podLabel = "system_u:object_r:container_file_t:s0:c1,c2"

// TestContextLabelsTheMount: a context= option reaches fsconfig as the
// bare label. Where the kernel runs SELinux, the mount's root carries the
// label (security.selinux). Where it does not, Build refuses with
// FailedPrecondition naming SELinux before the kernel is asked; asked
// anyway, the kernel answers a bare EINVAL from fsconfig, which is why.
func TestContextLabelsTheMount(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	dev := mountnstest.LoopDevice(t, dir, "ext4", 16)
	enabled := mountns.SELinuxEnabled()
	t.Logf("SELinux enabled on this kernel: %t", enabled)
	for _, m := range []plan.Mount{
		{Type: "tmpfs", Source: "mp-selinux", Options: []string{"nosuid", "nodev", "size=1m"}},
		{Type: "ext4", Source: dev, Options: []string{"nosuid", "nodev"}},
	} {
		m.Options = append(m.Options, plan.ContextOption(podLabel))
		t.Run(m.Type, func(t *testing.T) {
			fd, err := mountns.Build(m)
			if enabled {
				if err != nil {
					t.Fatalf("Build %s: %v", m, err)
				}
				defer fd.Close()
				if got := mountnstest.SELinuxLabel(t, fmt.Sprintf("/proc/self/fd/%d", fd.Fd())); got != podLabel {
					t.Fatalf("the mount's root is labelled %q, want %q", got, podLabel)
				}
				return
			}
			if err == nil {
				fd.Close()
				t.Fatal("Build with context= succeeded on a kernel without SELinux")
			}
			if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "SELinux is not enabled") {
				t.Fatalf("Build: %v, want FailedPrecondition saying SELinux is not enabled", err)
			}
			t.Logf("refused: %v", err)
			kernelRefuses(t, m)
		})
	}
}

// kernelRefuses builds m without the check: the kernel hands context= to
// the filesystem, which does not know it.
func kernelRefuses(t *testing.T, m plan.Mount) {
	t.Helper()
	saved := mountns.SELinuxEnabled
	mountns.SELinuxEnabled = func() bool { return true }
	defer func() { mountns.SELinuxEnabled = saved }()
	fd, err := mountns.Build(m)
	if err == nil {
		fd.Close()
		t.Fatal("the kernel took context= without SELinux")
	}
	if !errors.Is(err, unix.EINVAL) {
		t.Fatalf("unchecked Build: %v, want EINVAL from fsconfig", err)
	}
	t.Logf("what the kernel says unchecked: %v", err)
}

// TestContextRefusedOnBind: a bind shows its source's labels; asking it
// for one is refused whatever the kernel runs.
func TestContextRefusedOnBind(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	fd, err := mountns.Build(plan.Mount{Type: plan.TypeBind, Source: dir, Options: []string{"nosuid", plan.ContextOption(podLabel)}})
	if err == nil {
		fd.Close()
		t.Fatal("a bind took context=")
	}
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bind with context=: %v, want InvalidArgument", err)
	}
}
