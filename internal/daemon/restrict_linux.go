package daemon

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// startRestricted runs start (an os.StartProcess) on an OS thread of its
// own whose credentials are first reduced to what the daemon may have:
// no_new_privs, a capability bounding set of keep only, no inheritable and
// no ambient capabilities. All of these are attributes of a thread, which a
// child (made by clone on the calling thread) inherits and execve keeps;
// Go's SysProcAttr cannot set them, so they are set here, on a thread that
// nothing else ever runs on: the goroutine never unlocks it, so the
// runtime ends the thread with the goroutine. The daemon's execve then
// gives it at most keep (a root daemon has the bounding set as permitted
// and effective set; one of another user gets keep as ambient
// capabilities through SysProcAttr.AmbientCaps, which need them in the
// bounding set), and nothing it executes later can gain more.
func startRestricted(keep []uintptr, cgroupsV1 []string, start func() (*os.Process, error)) (*os.Process, error) {
	return startOnThread(true, keep, cgroupsV1, start)
}

// startOnThread runs start on an OS thread of its own, which nothing else
// ever runs on, first moved into cgroupsV1 (the daemon's cgroup v1 leaves,
// see joinThread) and, with restrict, reduced to keep (startRestricted).
func startOnThread(restrict bool, keep []uintptr, cgroupsV1 []string, start func() (*os.Process, error)) (*os.Process, error) {
	type result struct {
		p   *os.Process
		err error
	}
	ch := make(chan result, 1)
	var run func()
	run = func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The process's main thread: /proc/PID shows its credentials
			// as the process's, and the runtime never ends it. Run on
			// another thread, which it cannot be while this goroutine
			// holds the main one.
			done := make(chan struct{})
			go func() {
				defer close(done)
				run()
			}()
			<-done
			runtime.UnlockOSThread()
			return
		}
		// Never unlocked: see above.
		if err := joinThread(cgroupsV1); err != nil {
			ch <- result{err: err}
			return
		}
		if restrict {
			if err := restrictThread(keep); err != nil {
				ch <- result{err: err}
				return
			}
		}
		p, err := start()
		ch <- result{p, err}
	}
	go run()
	r := <-ch
	return r.p, r.err
}

// restrictThread reduces the calling thread's credentials (it must be
// locked to its goroutine): no_new_privs, no ambient and no inheritable
// capabilities, and a bounding set of keep only.
func restrictThread(keep []uintptr) error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_NO_NEW_PRIVS): %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("prctl(PR_CAP_AMBIENT_CLEAR_ALL): %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	if data[0].Inheritable != 0 || data[1].Inheritable != 0 {
		data[0].Inheritable, data[1].Inheritable = 0, 0
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capset (clearing the inheritable set): %w", err)
		}
	}
	permitted := data[0].Permitted != 0 || data[1].Permitted != 0
	for c := 0; c <= lastCap(); c++ {
		if slices.Contains(keep, uintptr(c)) {
			continue
		}
		on, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0)
		if errors.Is(err, unix.EINVAL) {
			break // past the kernel's last capability
		}
		if err != nil || on == 0 {
			continue
		}
		err = unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0)
		switch {
		case err == nil:
		case errors.Is(err, unix.EPERM) && !permitted:
			// A caller without any capability (a test as another user)
			// cannot shrink its bounding set, and needs not: it has
			// nothing to hand on, and no_new_privs keeps a setuid or
			// file-capability binary from adding anything.
			return nil
		default:
			return fmt.Errorf("prctl(PR_CAPBSET_DROP, %d): %w", c, err)
		}
	}
	return nil
}

// joinThread moves the calling thread (locked, never to run anything else)
// into each of dirs, cgroup v1 directories: cgroup v1 places threads, not
// processes, and a child made by clone on this thread starts in the
// thread's cgroups. So the daemon and everything it forks are in its own
// cgroups from their first instruction, and the mounter's other threads
// and processes stay where they are. The directories are the mounter's
// own (internal/daemon/cgroup), opened without following a symlink.
func joinThread(dirs []string) error {
	tid := []byte(strconv.Itoa(unix.Gettid()))
	for _, dir := range dirs {
		f, err := OpenNoSymlinks(filepath.Join(dir, "tasks"), unix.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("daemon cgroup %s: %w", dir, err)
		}
		_, err = f.Write(tid)
		f.Close()
		if err != nil {
			return fmt.Errorf("daemon cgroup %s: join: %w", dir, err)
		}
	}
	return nil
}
