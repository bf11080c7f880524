package daemon

import (
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// seccompChildEnv marks the test binary run again as the filtered child.
const seccompChildEnv = "MOUNTPLAN_SECCOMP_CHILD"

// TestDaemonSeccomp: an fd-mode daemon's filter (daemonPolicy), loaded in a
// child process as the sandbox's shim loads it, refuses a new user
// namespace (by unshare and by clone), a mount, keyctl, bpf and
// io_uring_setup with EPERM and clone3 with ENOSYS, and lets the rest
// through: the child still starts a thread-using program (sh running
// true), as a daemon starts ssh.
func TestDaemonSeccomp(t *testing.T) {
	if os.Getenv(seccompChildEnv) == "1" {
		seccompChild()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestDaemonSeccomp$", "-test.v")
	cmd.Env = append(os.Environ(), seccompChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("the filtered child:\n%s", out)
	if err != nil {
		t.Fatalf("the filtered child failed: %v", err)
	}
	for _, want := range []string{
		"unshare(CLONE_NEWUSER): operation not permitted",
		"clone(CLONE_NEWUSER): operation not permitted",
		"mount: operation not permitted",
		"keyctl: operation not permitted",
		"bpf: operation not permitted",
		"io_uring_setup: operation not permitted",
		"clone3: function not implemented",
		"getpid: ok",
		"sh -c true: ok",
		"Seccomp: 2",
	} {
		if !strings.Contains(string(out), want+"\n") {
			t.Errorf("the filtered child did not say %q", want)
		}
	}
}

// seccompChild loads the filter and reports what each call answers, one
// line each, then exits.
func seccompChild() {
	say := func(what string, err error) {
		if err == nil {
			os.Stdout.WriteString(what + ": ok\n")
			return
		}
		os.Stdout.WriteString(what + ": " + err.Error() + "\n")
	}
	// The filter is the thread's, as in the shim, which execs the daemon
	// from the thread it loaded it on.
	runtime.LockOSThread()
	if err := loadDaemonFilter(); err != nil {
		say("load", err)
		os.Exit(1)
	}
	raw := func(nr uintptr, args ...uintptr) error {
		a := append(args, 0, 0, 0, 0, 0, 0)
		if _, _, e := unix.Syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5]); e != 0 {
			return e
		}
		return nil
	}
	say("unshare(CLONE_NEWUSER)", unix.Unshare(unix.CLONE_NEWUSER))
	_, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{Sys: &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWUSER}})
	say("clone(CLONE_NEWUSER)", err)
	say("mount", unix.Mount("none", "/", "tmpfs", 0, ""))
	say("keyctl", raw(unix.SYS_KEYCTL, unix.KEYCTL_GET_KEYRING_ID, uintptr(0xfffffffd)))
	say("bpf", raw(unix.SYS_BPF, 0))
	say("io_uring_setup", raw(unix.SYS_IO_URING_SETUP, 1, 0))
	say("clone3", raw(unix.SYS_CLONE3, 0, 0))
	_, _, e := unix.RawSyscall(unix.SYS_GETPID, 0, 0, 0)
	if e != 0 {
		say("getpid", e)
	} else {
		say("getpid", nil)
	}
	say("sh -c true", exec.Command("/bin/sh", "-c", "true").Run())
	if b, err := os.ReadFile("/proc/thread-self/status"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "Seccomp:"); ok {
				os.Stdout.WriteString("Seccomp: " + strings.TrimSpace(v) + "\n")
			}
		}
	}
	os.Exit(0)
}
