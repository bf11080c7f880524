package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// WatchExit returns a channel that is closed when p exits (or is found
// gone). It polls a pidfd, which works for processes that are not this
// one's children (daemons taken back after a restart); stop ends the watch.
func WatchExit(p Proc) (exited <-chan struct{}, stop func()) {
	ch := make(chan struct{})
	pidfd, err := unix.PidfdOpen(p.PID, 0)
	if err != nil || !p.Alive() {
		// Gone already (a PID opened after its reuse fails the start time
		// check above: treat that as gone too).
		if err == nil {
			unix.Close(pidfd)
		}
		close(ch)
		return ch, func() {}
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(pidfd)
		return pollExit(p)
	}
	var mu sync.Mutex
	closed := false
	go func() {
		defer func() {
			mu.Lock()
			closed = true
			unix.Close(pidfd)
			unix.Close(efd)
			mu.Unlock()
		}()
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}, {Fd: int32(efd), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(fds, -1)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if fds[0].Revents != 0 || err != nil {
				close(ch)
			}
			return
		}
	}()
	return ch, func() {
		mu.Lock()
		defer mu.Unlock()
		if !closed {
			// The fd is still ours: wake the poll. Once closed, its number
			// may name another file.
			one := [8]byte{1}
			_, _ = unix.Write(efd, one[:])
		}
	}
}

// pollExit is WatchExit without an eventfd: it checks every 100ms.
func pollExit(p Proc) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		if wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
			return !p.Alive(), nil
		}) == nil {
			close(ch)
		}
	}()
	return ch, cancel
}

// Wait returns nil when p has exited, or ctx's error.
func Wait(ctx context.Context, p Proc) error {
	exited, stop := WatchExit(p)
	defer stop()
	select {
	case <-exited:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// SignalSession sends sig to the daemon and to every process of its
// session (ssh under sshfs, fusermount3 under rclone). A daemon is started
// as a session leader, so its session ID is its PID. A PID is not reused
// while any process still has it as its session or group ID, so while
// members remain they are the daemon's; when the leader itself has been
// replaced by an unrelated process with the same PID, nothing is sent.
func SignalSession(p Proc, sig unix.Signal) (sent int) {
	if p.PID <= 1 || p.PID == os.Getpid() {
		return 0
	}
	if st, ok := ReadStat(p.PID); ok && st.StartTime != p.StartTime {
		return 0 // the PID names another process now
	}
	for _, pid := range pids() {
		st, ok := ReadStat(pid)
		if !ok || st.Session != p.PID || st.State == 'Z' {
			continue
		}
		if pid == p.PID && st.StartTime != p.StartTime {
			continue
		}
		if unix.Kill(pid, sig) == nil {
			sent++
		}
	}
	return sent
}

func pids() []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	out := make([]int, 0, len(ents))
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// SessionAlive reports whether any live process remains in p's session.
func SessionAlive(p Proc) bool {
	if p.Alive() {
		return true
	}
	if p.PID <= 1 {
		return false
	}
	if st, ok := ReadStat(p.PID); ok && st.StartTime != p.StartTime {
		return false
	}
	for _, pid := range pids() {
		if st, ok := ReadStat(pid); ok && st.Session == p.PID && st.State != 'Z' {
			return true
		}
	}
	return false
}

// Terminate stops p's session: SIGTERM, then SIGKILL after grace; with a
// grace of 0, SIGKILL at once. It returns once no process of the session
// is left, or an error after a further grace period (at least a second).
func Terminate(ctx context.Context, p Proc, grace time.Duration) error {
	if p.PID <= 0 || !SessionAlive(p) {
		return nil
	}
	if grace > 0 {
		SignalSession(p, unix.SIGTERM)
		if waitGone(ctx, p, grace) {
			return nil
		}
	}
	SignalSession(p, unix.SIGKILL)
	if waitGone(ctx, p, max(grace, time.Second)) {
		return nil
	}
	return fmt.Errorf("daemon %s did not exit after SIGKILL", p)
}

// waitGone reports whether p's session is gone within d.
func waitGone(ctx context.Context, p Proc, d time.Duration) bool {
	return wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, d, true, func(context.Context) (bool, error) {
		return !SessionAlive(p), nil
	}) == nil
}
