// Package testenv decides what a test does when the machine lacks something
// it needs: root, a command, a device node, a kernel feature. Outside CI the
// test skips with a message naming what is missing, so that `go test ./...`
// as a normal user runs what it can. Under CI=true (CI sets it) the same
// test fails with that message: a CI run never passes by skipping.
//
// In -short mode (make test-unit) every Require* check skips its test,
// whatever the machine has: the short run is the tests that need no root,
// no device, no external tool and no server, as a normal user.
//
// Every test of the module goes through this package for such checks;
// test/testutil re-exports it for the end-to-end suites.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// InCI reports whether the tests run in CI (CI=true), where a missing
// prerequisite is a failure.
func InCI() bool { return os.Getenv("CI") == "true" }

// Missing stops t because the machine lacks what the test needs, as
// described by format and args ("root", "/dev/fuse", ...): t skips outside
// CI and fails under CI=true.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	what := fmt.Sprintf(format, args...)
	if InCI() {
		t.Fatalf("missing prerequisite under CI=true: %s (install it, e.g. hack/install-deps.sh, or run where it is available)", what)
	} else {
		t.Skipf("skipping: missing prerequisite: %s", what)
	}
}

// ShortSkip begins the message of every skip that -short mode asks for;
// hack/testreport counts those apart from the others.
const ShortSkip = "skipping in -short mode"

// skipShort skips t in -short mode, which leaves out every test that needs
// what: root, a tool, a device.
func skipShort(t testing.TB, what string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("%s (make test-unit): needs %s", ShortSkip, what)
	}
}

// RequireRoot stops t (see Missing) unless it runs as root; it skips in
// -short mode.
func RequireRoot(t testing.TB) {
	t.Helper()
	skipShort(t, "root")
	if os.Geteuid() != 0 {
		Missing(t, "root (real loop devices, mounts and namespaces); run the root tests as root, e.g. `sudo -E go test ./...`")
	}
}

// RequireFile stops t (see Missing) unless path exists; what says what it
// is, e.g. "the FUSE device". It skips in -short mode.
func RequireFile(t testing.TB, path, what string) {
	t.Helper()
	skipShort(t, path)
	if _, err := os.Stat(path); err != nil {
		Missing(t, "%s %s: %v", what, path, err)
	}
}

// RequireCommands stops t (see Missing) when any of the named commands is
// not in PATH, naming the missing ones and the Debian packages that provide
// them (all of which hack/install-deps.sh installs). It skips in -short
// mode.
func RequireCommands(t testing.TB, names ...string) {
	t.Helper()
	skipShort(t, strings.Join(names, ", "))
	var missing []string
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			if pkg, ok := CommandPackages[n]; ok {
				n += " (Debian package " + pkg + ")"
			}
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		Missing(t, "commands %s", strings.Join(missing, ", "))
	}
}

// CommandPackages names the Debian package that provides each command the
// tests run. TestInstallDepsCoversCommands checks that hack/install-deps.sh
// installs every one of them.
var CommandPackages = map[string]string{
	"containerd":         "containerd",
	"ctr":                "containerd",
	"runc":               "runc",
	"busybox":            "busybox-static",
	"unshare":            "util-linux",
	"nsenter":            "util-linux",
	"losetup":            "util-linux",
	"blkid":              "util-linux",
	"mkfs.ext4":          "e2fsprogs",
	"mke2fs":             "e2fsprogs",
	"resize2fs":          "e2fsprogs",
	"dumpe2fs":           "e2fsprogs",
	"e2fsck":             "e2fsprogs",
	"mkfs.xfs":           "xfsprogs",
	"xfs_growfs":         "xfsprogs",
	"xfs_db":             "xfsprogs",
	"mksquashfs":         "squashfs-tools",
	"mkfs.erofs":         "erofs-utils",
	"fusermount3":        "fuse3",
	"sshfs":              "sshfs",
	"rclone":             "rclone",
	"squashfuse":         "squashfuse",
	"checkpolicy":        "checkpolicy",
	"sshd":               "openssh-server",
	"ssh-keygen":         "openssh-client",
	"nbdkit":             "nbdkit",
	"tgtd":               "tgt",
	"tgtadm":             "tgt",
	"iscsid":             "open-iscsi",
	"iscsiadm":           "open-iscsi",
	"qemu-system-x86_64": "qemu-system-x86",
	"ip":                 "iproute2",
	"mmdebstrap":         "mmdebstrap",
	"modprobe":           "kmod",
	"depmod":             "kmod",
	"xz":                 "xz-utils",
	"protoc":             "protobuf-compiler",
}
