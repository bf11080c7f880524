package testutil

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// RequireRoot skips the test unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (real loop devices, mounts and namespaces); run the root tests as root, e.g. `sudo -E go test ./...`")
	}
}

// commandPackages names the Debian package that provides a command, for skip
// messages.
var commandPackages = map[string]string{
	"containerd": "containerd",
	"ctr":        "containerd",
	"runc":       "runc",
	"busybox":    "busybox-static",
	"unshare":    "util-linux",
	"nsenter":    "util-linux",
	"losetup":    "util-linux",
	"mkfs.ext4":  "e2fsprogs",
	"mkfs.xfs":   "xfsprogs",
	"mksquashfs": "squashfs-tools",
	"mkfs.erofs": "erofs-utils",
}

// RequireCommands skips the test when any of the named commands is not in
// PATH, naming the missing ones and the Debian packages that provide them.
func RequireCommands(t testing.TB, names ...string) {
	t.Helper()
	var missing []string
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			if pkg, ok := commandPackages[n]; ok {
				n += " (Debian package " + pkg + ")"
			}
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		t.Skipf("skipping: missing commands: %s", strings.Join(missing, ", "))
	}
}
