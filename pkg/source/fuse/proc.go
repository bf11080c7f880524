package fuse

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Proc identifies a daemon process across PID reuse: its PID and its start
// time in clock ticks after boot (/proc/PID/stat field 22).
type Proc struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"`
}

func (p Proc) String() string { return fmt.Sprintf("pid %d (start %d)", p.PID, p.StartTime) }

// procStat is the part of /proc/PID/stat the supervisor needs.
type procStat struct {
	state     byte
	session   int
	startTime uint64
}

// readStat reads /proc/PID/stat. ok is false when the process is gone.
func readStat(pid int) (procStat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	// The command name is in parentheses and may hold spaces or ')': the
	// fields resume after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procStat{}, false
	}
	st := procStat{state: f[0][0]}
	st.session, _ = strconv.Atoi(f[3])
	st.startTime, _ = strconv.ParseUint(f[19], 10, 64)
	return st, true
}

// identify returns the identity of a running pid.
func identify(pid int) (Proc, error) {
	st, ok := readStat(pid)
	if !ok {
		return Proc{}, fmt.Errorf("process %d exited at once", pid)
	}
	return Proc{PID: pid, StartTime: st.startTime}, nil
}

// Alive reports whether p still runs: same PID and start time, and not a
// zombie (a zombie has exited).
func (p Proc) Alive() bool {
	if p.PID <= 0 {
		return false
	}
	st, ok := readStat(p.PID)
	return ok && st.startTime == p.StartTime && st.state != 'Z' && st.state != 'X'
}

// watchExit returns a channel that is closed when p exits (or is found
// gone). It polls a pidfd, which works for processes that are not this
// one's children (daemons adopted after a restart); stop ends the watch.
func watchExit(p Proc) (exited <-chan struct{}, stop func()) {
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
func pollExit(p Proc) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if !p.Alive() {
					close(ch)
					return
				}
			}
		}
	}()
	return ch, cancel
}

// signalSession sends sig to the daemon and to every process of its
// session (ssh under sshfs, fusermount3 under rclone). A daemon is started
// as a session leader, so its session ID is its PID. A PID is not reused
// while any process still has it as its session or group ID, so while
// members remain they are the daemon's; when the leader itself has been
// replaced by an unrelated process with the same PID, nothing is sent.
func signalSession(p Proc, sig unix.Signal) (sent int) {
	if p.PID <= 1 {
		return 0
	}
	if st, ok := readStat(p.PID); ok && st.startTime != p.StartTime {
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
		st, ok := readStat(pid)
		if !ok || st.session != p.PID || st.state == 'Z' {
			continue
		}
		if pid == p.PID && st.startTime != p.StartTime {
			continue
		}
		if unix.Kill(pid, sig) == nil {
			sent++
		}
	}
	return sent
}

// sessionAlive reports whether any live process remains in p's session.
func sessionAlive(p Proc) bool {
	if p.Alive() {
		return true
	}
	if st, ok := readStat(p.PID); ok && st.startTime != p.StartTime {
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
		if st, ok := readStat(pid); ok && st.session == p.PID && st.state != 'Z' {
			return true
		}
	}
	return false
}

// terminate stops p's session: SIGTERM, then SIGKILL after grace. It
// returns once no process of the session is left, or an error after a
// further grace period.
func terminate(ctx context.Context, p Proc, grace time.Duration) error {
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

func waitGone(ctx context.Context, p Proc, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for sessionAlive(p) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}
