//go:build linux

package mountnstest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// containerScript makes, inside a new private mount namespace, what a
// container runtime makes: a root of its own (a tmpfs with busybox in
// it) that the process pivot_roots into, the host's tree detached below
// it, then sleeps. Unlike Namespace's, this namespace is not rooted at the
// host's "/": nothing of the host is reachable from it by path. (Its
// process keeps root's capabilities: what the mounter decides must not
// depend on what a consumer's process holds.)
const containerScript = `set -e
root=$1
mount -t tmpfs -o size=8m,mode=755 mountplan-ctr "$root"
mkdir -p "$root/bin" "$root/proc" "$root/old" "$root/tmp"
cp /bin/busybox "$root/bin/busybox"
mount -t proc proc "$root/proc"
cd "$root"
pivot_root . old
/bin/busybox umount -l /old
/bin/busybox rmdir /old
exec /bin/busybox sleep 300
`

// Container starts a process in a pivot_root-ed mount namespace (see
// containerScript) and returns its PID once it sleeps there. Cleanup kills
// it; the kernel drops the namespace's mounts with its last process. Paths
// inside it are its own: /tmp is an empty directory of its tmpfs root.
func Container(t testing.TB) int {
	t.Helper()
	RequireTool(t, "unshare", "busybox")
	root := t.TempDir()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", containerScript, "sh", root)
	out, err := os.CreateTemp(t.TempDir(), "container-*.log")
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the container: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	pid := cmd.Process.Pid
	// The script execs sleep only once it is inside its own root.
	if poll(func() bool {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		return err == nil && string(b) == "/bin/busybox\x00sleep\x00300\x00"
	}) {
		return pid
	}
	b, _ := os.ReadFile(out.Name())
	t.Fatalf("the container did not reach sleep within 10s: %s", b)
	return 0
}
