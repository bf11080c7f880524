package daemon

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// capNames are the capabilities of linux/capability.h by number, without
// their CAP_ prefix.
var capNames = []string{
	"CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
	"LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
	"SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
	"SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
	"MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
	"CHECKPOINT_RESTORE",
}

// DefaultCapabilities is what a daemon keeps when its profile names none:
// what a FUSE daemon needs to mount its file system itself.
var DefaultCapabilities = []string{"SYS_ADMIN"}

// ParseCapabilities checks capability names (SYS_ADMIN or CAP_SYS_ADMIN,
// any case) and returns them canonical (SYS_ADMIN), sorted, each once.
// An unknown name is errdefs.ErrInvalidArgument.
func ParseCapabilities(names []string) ([]string, error) {
	out := make([]string, 0, len(names))
	for _, n := range names {
		c := strings.TrimPrefix(strings.ToUpper(n), "CAP_")
		if !slices.Contains(capNames, c) {
			return nil, fmt.Errorf("unknown capability %q (known: %s): %w", n, strings.Join(capNames, ", "), errdefs.ErrInvalidArgument)
		}
		if !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	slices.Sort(out)
	return out, nil
}

// capNumbers returns the numbers of canonical capability names.
func capNumbers(names []string) ([]uintptr, error) {
	out := make([]uintptr, 0, len(names))
	for _, n := range names {
		i := slices.Index(capNames, n)
		if i < 0 {
			return nil, fmt.Errorf("unknown capability %q: %w", n, errdefs.ErrInvalidArgument)
		}
		out = append(out, uintptr(i))
	}
	return out, nil
}

// CapabilityMask is the bit mask of canonical capability names, as
// /proc/PID/status shows capability sets (CapEff, CapBnd, ...).
func CapabilityMask(names []string) uint64 {
	var m uint64
	for _, n := range names {
		if i := slices.Index(capNames, n); i >= 0 {
			m |= 1 << i
		}
	}
	return m
}

// lastCap is the highest capability number the kernel knows: every
// capability up to it that a daemon may not have is dropped from its
// bounding set, also those newer than capNames.
func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n >= 0 && n < 64 {
			return n
		}
	}
	return 63 // dropping one the kernel lacks is EINVAL, which is skipped
}
