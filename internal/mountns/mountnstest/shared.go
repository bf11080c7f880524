//go:build linux

package mountnstest

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// SharedNamespace is a mount namespace with two processes in it, like a
// container whose first process may exit while others live on.
type SharedNamespace struct {
	First, Second int // PIDs
	first         *exec.Cmd
}

// NewSharedNamespace starts `unshare --mount --propagation <propagation>`
// running a shell that starts a second sleep in the background and then
// execs sleep itself (First). Cleanup kills both; the kernel drops the
// namespace's mounts with its last process.
func NewSharedNamespace(t testing.TB, propagation string) *SharedNamespace {
	t.Helper()
	RequireTool(t, "unshare", "sh", "sleep")
	cmd := exec.Command("unshare", "--mount", "--propagation", propagation,
		"sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $!; exec sleep 300")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start unshare: %v", err)
	}
	s := &SharedNamespace{First: cmd.Process.Pid, first: cmd}
	t.Cleanup(func() {
		s.KillFirst()
		if s.Second != 0 {
			_ = syscall.Kill(s.Second, syscall.SIGKILL)
		}
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("read the second pid from unshare's shell: %v", err)
	}
	if s.Second, err = strconv.Atoi(strings.TrimSpace(line)); err != nil {
		t.Fatalf("second pid %q: %v", line, err)
	}
	// The shell runs inside the namespace, so the second sleep is in it
	// too; wait until the first has exec'd sleep as well.
	comm := "/proc/" + strconv.Itoa(s.First) + "/comm"
	if poll(func() bool { b, err := os.ReadFile(comm); return err == nil && string(b) == "sleep\n" }) {
		return s
	}
	t.Fatalf("unshare did not reach sleep within 10s")
	return nil
}

// KillFirst kills the first process and reaps it: its PID no longer exists
// when KillFirst returns. The second lives on in the namespace.
func (s *SharedNamespace) KillFirst() {
	if s.first == nil {
		return
	}
	_ = s.first.Process.Kill()
	_ = s.first.Wait()
	s.first = nil
}

// KillSecond kills the second process and waits until it no longer is in
// the namespace (it is not the test's child, so another process reaps it).
func (s *SharedNamespace) KillSecond(t testing.TB) {
	t.Helper()
	pid := s.Second
	_ = syscall.Kill(pid, syscall.SIGKILL)
	ns := "/proc/" + strconv.Itoa(pid) + "/ns/mnt"
	s.Second = 0 // its PID may be reused: cleanup must not kill it again
	if !poll(func() bool { _, err := os.Stat(ns); return err != nil }) {
		t.Fatalf("pid %d still has a mount namespace 10s after SIGKILL", pid)
	}
}
