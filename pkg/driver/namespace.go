package driver

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/journal"
)

// nsIdentity names a mount namespace. The inode is what the API carries,
// but the kernel reuses it as soon as the namespace dies (the next
// `unshare -m` often gets the same number); the 64-bit namespace ID
// (NS_GET_MNTNS_ID, Linux 6.9+) is never reused, so it is what proves that
// a recorded consumer still lives. It is 0 where the kernel lacks it.
type nsIdentity struct{ inode, id uint64 }

func nsPath(pid int) string { return filepath.Join("/proc", strconv.Itoa(pid), "ns", "mnt") }

// namespaceOf returns the identity of pid's mount namespace.
func namespaceOf(pid int) (nsIdentity, error) {
	f, err := os.Open(nsPath(pid))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
			return nsIdentity{}, fmt.Errorf("process %d does not exist: %w", pid, errdefs.ErrNotFound)
		}
		return nsIdentity{}, fmt.Errorf("open %s: %w", nsPath(pid), err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nsIdentity{}, fmt.Errorf("stat %s: %w", nsPath(pid), err)
	}
	id, err := unix.IoctlGetUint64(int(f.Fd()), unix.NS_GET_MNTNS_ID)
	if err != nil {
		id = 0 // an older kernel: the inode is all there is
	}
	return nsIdentity{inode: st.Ino, id: id}, nil
}

// is reports whether ns is the namespace c recorded.
func (ns nsIdentity) is(c journal.Consumer) bool {
	return ns.inode == c.NSInode && (c.NSID == 0 || ns.id == c.NSID)
}

// namespaceAlive reports whether any process is still in c's mount
// namespace. The recorded PID is checked first; only when it has gone are
// other processes searched (a container's namespace outlives any one of
// its processes), by inode with a cheap stat, confirmed by namespace ID.
func namespaceAlive(c journal.Consumer) bool {
	if ns, err := namespaceOf(c.PID); err == nil && ns.is(c) {
		return true
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return true // cannot tell: keep the consumer
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(nsPath(pid), &st) != nil || st.Ino != c.NSInode {
			continue
		}
		if ns, err := namespaceOf(pid); err == nil && ns.is(c) {
			return true
		}
	}
	return false
}
