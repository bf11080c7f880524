package daemon

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Proc identifies a daemon process across PID reuse: its PID and its start
// time in clock ticks after boot (/proc/PID/stat field 22).
type Proc struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"`
}

func (p Proc) String() string { return fmt.Sprintf("pid %d (start %d)", p.PID, p.StartTime) }

// Stat is the part of /proc/PID/stat that identifies and classifies a
// process, and the CPU time it has used.
type Stat struct {
	State     byte // R, S, D, Z, X, ...
	PPID      int
	Session   int
	UTime     uint64 // user CPU time in clock ticks (USER_HZ), exited threads included
	STime     uint64 // system CPU time in clock ticks (USER_HZ), exited threads included
	StartTime uint64 // clock ticks after boot: with the PID, identifies a process across PID reuse
}

// ReadStat reads /proc/PID/stat. ok is false when the process is gone.
func ReadStat(pid int) (st Stat, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Stat{}, false
	}
	// The command name is in parentheses and may hold spaces or ')': the
	// fields resume after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Stat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return Stat{}, false
	}
	// f[i] is field i+3 of proc_pid_stat(5).
	st = Stat{State: f[0][0]}
	st.PPID, _ = strconv.Atoi(f[1])
	st.Session, _ = strconv.Atoi(f[3])
	st.UTime, _ = strconv.ParseUint(f[11], 10, 64)
	st.STime, _ = strconv.ParseUint(f[12], 10, 64)
	st.StartTime, _ = strconv.ParseUint(f[19], 10, 64)
	return st, true
}

// Identify returns the identity of a running pid.
func Identify(pid int) (Proc, error) {
	st, ok := ReadStat(pid)
	if !ok {
		return Proc{}, fmt.Errorf("process %d exited at once", pid)
	}
	return Proc{PID: pid, StartTime: st.StartTime}, nil
}

// Alive reports whether p still runs: same PID and start time, and not a
// zombie (a zombie has exited).
func (p Proc) Alive() bool {
	if p.PID <= 0 {
		return false
	}
	st, ok := ReadStat(p.PID)
	return ok && st.StartTime == p.StartTime && st.State != 'Z' && st.State != 'X'
}
