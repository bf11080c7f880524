package testutil

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/mountplan/mountplan/internal/daemon"
)

// ProcInfo is one process as /proc shows it.
type ProcInfo struct {
	PID       int
	PPID      int
	State     byte   // R, S, D, Z, ...
	StartTime uint64 // clock ticks after boot: with PID, identifies a process across PID reuse
	Cmdline   string // arguments joined by spaces; empty for kernel threads
}

func (p ProcInfo) String() string {
	cmd := p.Cmdline
	if cmd == "" {
		cmd = "?"
	}
	s := fmt.Sprintf("pid %d (ppid %d): %s", p.PID, p.PPID, cmd)
	if p.State == 'Z' {
		s += " [zombie: exited but never waited for]"
	}
	return s
}

// readProc reads /proc/PID/stat and /proc/PID/cmdline. ok is false when the
// process is gone.
func readProc(pid int) (ProcInfo, bool) {
	st, ok := daemon.ReadStat(pid)
	if !ok {
		return ProcInfo{}, false
	}
	p := ProcInfo{PID: pid, PPID: st.PPID, State: st.State, StartTime: st.StartTime}
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		p.Cmdline = strings.TrimSpace(string(bytes.ReplaceAll(cmd, []byte{0}, []byte{' '})))
	}
	return p, true
}

// readProcs reads every process (thread group) in /proc.
func readProcs() map[int]ProcInfo {
	ents, _ := os.ReadDir("/proc")
	procs := make(map[int]ProcInfo, len(ents))
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, ok := readProc(pid); ok {
			procs[pid] = p
		}
	}
	return procs
}

// alive reports whether pid still names the process that started at start
// and has not exited (a zombie has exited).
func alive(pid int, start uint64) bool {
	p, ok := readProc(pid)
	return ok && p.StartTime == start && p.State != 'Z'
}

// isKernelThread reports whether p is a kernel thread: kthreadd (PID 2) and
// its children, which have no command line.
func isKernelThread(p ProcInfo) bool {
	return p.PID == 2 || p.PPID == 2 || (p.PPID == 0 && p.PID != 1)
}

var goroot = sync.OnceValue(func() string {
	gobin, err := exec.LookPath("go")
	if err != nil {
		return ""
	}
	if r, err := filepath.EvalSymlinks(gobin); err == nil {
		gobin = r
	}
	return filepath.Dir(filepath.Dir(gobin))
})

// isGoToolchain reports whether pid runs a binary of the Go toolchain (go,
// compile, link, vet, ...): a test may build things while it runs, and
// those processes belong to no product.
func isGoToolchain(pid int) bool {
	root := goroot()
	if root == "" {
		return false
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	return err == nil && strings.HasPrefix(exe, root+string(filepath.Separator))
}

// descendants returns the PIDs in procs that descend from pid (not pid
// itself).
func descendants(procs map[int]ProcInfo, pid int) []int {
	children := map[int][]int{}
	for _, p := range procs {
		children[p.PPID] = append(children[p.PPID], p.PID)
	}
	var out []int
	queue := append([]int(nil), children[pid]...)
	for len(queue) > 0 {
		c := queue[0]
		queue = queue[1:]
		out = append(out, c)
		queue = append(queue, children[c]...)
	}
	return out
}

// SocketHolders lists the processes that hold a unix socket bound to path
// (from /proc/net/unix and /proc/*/fd): who still serves on a socket whose
// owner is gone.
func SocketHolders(path string) []ProcInfo {
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		return nil
	}
	inodes := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 8 && f[len(f)-1] == path {
			inodes["socket:["+f[6]+"]"] = true
		}
	}
	var out []ProcInfo
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(filepath.Join("/proc", e.Name(), "fd"))
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join("/proc", e.Name(), "fd", fd.Name())); err == nil && inodes[l] {
				if p, ok := readProc(pid); ok {
					out = append(out, p)
				}
				break
			}
		}
	}
	return out
}

// closed reports, without waiting, whether ch is closed: whether the
// process whose done channel it is has ended.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
