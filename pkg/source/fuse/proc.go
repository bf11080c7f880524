package fuse

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/periodic"
)

// watchExit returns a channel that is closed when p exits (or is found
// gone). It polls a pidfd, which works for processes that are not this
// one's children (daemons adopted after a restart); stop ends the watch.
func watchExit(p daemon.Proc) (exited <-chan struct{}, stop func()) {
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

// pollExit is watchExit without an eventfd: it checks every 100ms.
func pollExit(p daemon.Proc) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	go periodic.Every(ctx, 100*time.Millisecond, func(context.Context) bool {
		if !p.Alive() {
			close(ch)
			return false
		}
		return true
	})
	return ch, cancel
}

// signalSession sends sig to the daemon and to every process of its
// session (ssh under sshfs, fusermount3 under rclone). A daemon is started
// as a session leader, so its session ID is its PID. A PID is not reused
// while any process still has it as its session or group ID, so while
// members remain they are the daemon's; when the leader itself has been
// replaced by an unrelated process with the same PID, nothing is sent.
func signalSession(p daemon.Proc, sig unix.Signal) (sent int) {
	if p.PID <= 1 {
		return 0
	}
	if st, ok := daemon.ReadStat(p.PID); ok && st.StartTime != p.StartTime {
		return 0 // the PID names another process now
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, ok := daemon.ReadStat(pid)
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

// sessionAlive reports whether any live process remains in p's session.
func sessionAlive(p daemon.Proc) bool {
	if p.Alive() {
		return true
	}
	if st, ok := daemon.ReadStat(p.PID); ok && st.StartTime != p.StartTime {
		return false
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return false
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, ok := daemon.ReadStat(pid); ok && st.Session == p.PID && st.State != 'Z' {
			return true
		}
	}
	return false
}

// terminate stops p's session: SIGTERM, then SIGKILL after grace. It
// returns once no process of the session is left, or an error after a
// further grace period.
func terminate(ctx context.Context, p daemon.Proc, grace time.Duration) error {
	if p.PID <= 0 || !sessionAlive(p) {
		return nil
	}
	signalSession(p, unix.SIGTERM)
	if waitGone(ctx, p, grace) {
		return nil
	}
	signalSession(p, unix.SIGKILL)
	if waitGone(ctx, p, grace) {
		return nil
	}
	return fmt.Errorf("daemon %s did not exit after SIGKILL", p)
}

func waitGone(ctx context.Context, p daemon.Proc, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for sessionAlive(p) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}
