package testutil

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
)

// Proc is a process that holds a private mount namespace: `unshare -m
// --propagation private sleep infinity`. Mounts made inside it never reach
// the host; they vanish when it is killed.
type Proc struct {
	PID  int
	cmd  *exec.Cmd
	done chan struct{}
	once sync.Once
}

// StartUnshare starts a process in a new mount namespace, with private
// propagation, and waits until the namespace exists. It is killed at the
// end of the test if the test has not killed it.
func StartUnshare(t testing.TB) *Proc {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "unshare")
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "infinity")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting unshare: %v", err)
	}
	p := &Proc{PID: cmd.Process.Pid, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(p.Kill)

	self, err := MountNamespaceOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// unshare(1) execs sleep in the same process once the namespace is set
	// up: wait until the process's namespace differs from ours.
	var ns string
	ok := Poll(5*time.Second, 5*time.Millisecond, func() bool {
		if closed(p.done) {
			return true
		}
		ns, _ = MountNamespaceOf(p.PID)
		return ns != "" && ns != self && procComm(p.PID) == "sleep"
	})
	select {
	case <-p.done:
		t.Fatalf("unshare exited early: %s", strings.TrimSpace(stderr.String()))
	default:
	}
	if !ok {
		t.Fatalf("unshare: pid %d did not enter a new mount namespace within 5s", p.PID)
	}
	return p
}

func procComm(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(b))
}

// Kill kills the process with SIGKILL and waits until it is reaped. Once
// it is gone, the kernel tears its mount namespace down (asynchronously).
// Calling Kill again does nothing.
func (p *Proc) Kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
}

// MountNS returns the identity of the process's mount namespace, like
// "mnt:[4026532283]".
func (p *Proc) MountNS() string {
	ns, _ := MountNamespaceOf(p.PID)
	return ns
}

// Exec runs argv in the process's mount namespace; see Exec.
func (p *Proc) Exec(t testing.TB, argv ...string) (string, error) {
	t.Helper()
	return Exec(t, p.PID, argv...)
}

// Exec runs argv inside the mount namespace of pid with nsenter(1) (tests
// only: the product must not use it) and returns its standard output. On
// failure the error carries the exit status and standard error. Entering a
// mount namespace also moves to its root directory, so argv[0] is looked
// up in the namespace's file system: in a busybox container, it runs
// busybox's applet. It gives up after a minute.
func Exec(t testing.TB, pid int, argv ...string) (string, error) {
	t.Helper()
	RequireCommands(t, "nsenter")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := append([]string{"-t", fmt.Sprint(pid), "-m", "--"}, argv...)
	return runCmd(ctx, "nsenter", args...)
}

// runCmd runs a command and returns its standard output; its error
// includes the command, the exit status and standard error.
func runCmd(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		// What the command said comes first: a summary of a failed run
		// (CI's) keeps only the start of a line, and the command line is
		// long.
		return stdout.String(), fmt.Errorf("%s: %w: %s (ran: %s %s)",
			filepath.Base(name), err, strings.TrimSpace(stderr.String()), name, strings.Join(args, " "))
	}
	return stdout.String(), nil
}

// MountInfoOf parses /proc/PID/mountinfo: the mounts that process sees.
func MountInfoOf(pid int) ([]*mountinfo.Info, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return mountinfo.GetMountsFromReader(f, nil)
}

// MountNamespaceOf returns the identity of pid's mount namespace, like
// "mnt:[4026532283]": equal strings mean the same namespace.
func MountNamespaceOf(pid int) (string, error) {
	return os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
}
