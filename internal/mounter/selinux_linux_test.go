//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
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

	// A label that is not one label is refused as the request arrives,
	// whatever the profile and the kernel: nothing rides in it.
	for _, bad := range []string{`system_u:object_r:t:s0",allow_other`, "system_u:object_r:t:s0\nx", "a:b"} {
		smuggled := f.request("smuggled", "squashfuse-user-fd")
		smuggled.SELinuxContext = bad
		if _, err := f.n.StartDaemon(ctx, smuggled); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("a daemon labelled %q: %v, want InvalidArgument", bad, err)
		}
		f.gone("smuggled")
	}

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
		if got := mountnstest.SELinuxLabel(t, p); got != podLabel {
			t.Errorf("%s is labelled %q, want %q", p, got, podLabel)
		} else {
			t.Logf("%s labelled %s", p, got)
		}
	}
	f.stop("labelled", true)
	f.gone("labelled")
}
