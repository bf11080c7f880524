//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
)

// podLabel is a pod's label as kubelet's SELinuxMount sends it.
const podLabel = "system_u:object_r:container_file_t:s0:c1,c2"

// TestFdModeContextLabel (issue 36): a FUSE volume staged with an SELinux
// label gets it on the mount the mounter makes in fd mode, so every file
// the daemon serves carries it. A daemon that mounts by itself cannot be
// made to: it is refused, naming fdMount. Where the kernel runs no
// SELinux, the labelled start is refused with FailedPrecondition naming
// SELinux and leaves nothing. MOUNTPLAN_WANT_SELINUX=1 (the guest of
// make test-vm's SELinux boot) makes a kernel without SELinux a failure.
func TestFdModeContextLabel(t *testing.T) {
	f := newDaemonFixture(t)
	ctx := context.Background()

	own := f.request("own", "squashfuse")
	own.SELinuxContext = podLabel
	if _, err := f.n.StartDaemon(ctx, own); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "fdMount") {
		t.Errorf("a labelled daemon that mounts by itself: %v, want FailedPrecondition naming fdMount", err)
	}
	f.gone("own")

	req := f.request("labelled", "squashfuse-user-fd")
	req.SELinuxContext = podLabel
	if !mountns.SELinuxEnabled() {
		if os.Getenv("MOUNTPLAN_WANT_SELINUX") == "1" {
			t.Fatal("MOUNTPLAN_WANT_SELINUX=1, but the kernel runs no SELinux (no selinuxfs in /proc/filesystems)")
		}
		_, err := f.n.StartDaemon(ctx, req)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "SELinux is not enabled") {
			t.Fatalf("a labelled FUSE volume where SELinux is off: %v, want FailedPrecondition naming SELinux", err)
		}
		t.Logf("SELinux is off here: %v", err)
		f.gone("labelled")
		return
	}
	info := f.start(req)
	for _, p := range []string{info.MountPoint, filepath.Join(info.MountPoint, "hello.txt")} {
		buf := make([]byte, 256)
		n, err := unix.Getxattr(p, "security.selinux", buf)
		if err != nil {
			t.Fatalf("getxattr %s security.selinux: %v", p, err)
		}
		if got := strings.TrimRight(string(buf[:n]), "\x00"); got != podLabel {
			t.Errorf("%s is labelled %q, want %q", p, got, podLabel)
		} else {
			t.Logf("%s labelled %s", p, got)
		}
	}
	f.stop("labelled", true)
	f.gone("labelled")
}
