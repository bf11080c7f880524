package fdlimit

import (
	"errors"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Raise lifts the process's RLIMIT_NOFILE, soft and hard, to want, capped
// by fs.nr_open (the most the kernel allows). Without CAP_SYS_RESOURCE the
// hard limit cannot grow: the soft limit is raised to the hard one and
// Raise returns the limit in force with the EPERM. It never lowers a limit.
//
// It calls prlimit(2) directly, not syscall.Setrlimit: when the process
// started with a soft limit below its hard one, Go then still restores the
// limits it started with in the children it runs (mkfs, blkid), which have
// no use for the plugin's budget.
func Raise(want uint64) (unix.Rlimit, error) {
	var cur unix.Rlimit
	if err := unix.Prlimit(0, unix.RLIMIT_NOFILE, nil, &cur); err != nil {
		return cur, err
	}
	if n, err := nrOpen(); err == nil && n < want {
		want = n
	}
	if cur.Cur >= want {
		return cur, nil
	}
	next := unix.Rlimit{Cur: want, Max: max(want, cur.Max)}
	err := unix.Prlimit(0, unix.RLIMIT_NOFILE, &next, nil)
	if errors.Is(err, unix.EPERM) && cur.Cur < cur.Max {
		// No CAP_SYS_RESOURCE: the hard limit is the budget.
		next = unix.Rlimit{Cur: cur.Max, Max: cur.Max}
		if serr := unix.Prlimit(0, unix.RLIMIT_NOFILE, &next, nil); serr != nil {
			return cur, serr
		}
		return next, err
	}
	if err != nil {
		return cur, err
	}
	return next, nil
}

func nrOpen() (uint64, error) {
	b, err := os.ReadFile("/proc/sys/fs/nr_open")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
}
