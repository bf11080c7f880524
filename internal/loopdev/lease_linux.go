package loopdev

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// ErrOpenElsewhere says that a file has another open file description
// than the caller's: every bound loop device holds one of its backing file
// for as long as it is bound, whoever attached it.
var ErrOpenElsewhere = errors.New("file is open elsewhere")

// leaseFilesystems are the filesystems whose leases count every open of
// the inode a loop device can hold. On a stacking filesystem (overlayfs,
// FUSE, NFS) a device attached through the lower path holds the lower
// inode, which the upper inode's lease does not see.
var leaseFilesystems = map[int64]bool{
	unix.EXT4_SUPER_MAGIC:  true, // ext2, ext3 and ext4 share the magic
	unix.XFS_SUPER_MAGIC:   true,
	unix.BTRFS_SUPER_MAGIC: true,
	unix.TMPFS_MAGIC:       true,
}

// WhileUnopened runs fn while the kernel guarantees that nobody but the
// caller has path open: it takes a write lease (F_SETLEASE F_WRLCK), which
// the kernel grants only while the inode has no open file description
// besides the caller's, and holds it while fn runs, so that an open of path
// by anyone else (losetup, a mount's probe) waits until fn is done. This
// is one syscall whatever the number of loop devices on the node, where a
// walk of /sys/block opens every bound device.
//
// It fails with an error wrapping ErrOpenElsewhere (and
// errdefs.ErrFailedPrecondition) while any loop device is bound to the
// file, a device that is only being released included; with
// errdefs.ErrNotFound when path does not exist; and with
// errdefs.ErrUnimplemented when the filesystem gives no answer that can be
// trusted (leases disabled, a stacking filesystem): then the caller falls
// back to FindByBacking.
func WhileUnopened(path string, fn func() error) (err error) {
	// O_NONBLOCK: should anyone hold a lease on the file, fail instead of
	// waiting for it to be broken.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return sysErr("open", path, err)
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return sysErr("fstatfs", path, err)
	}
	if !leaseFilesystems[int64(st.Type)] {
		return fmt.Errorf("loopdev: %s: leases on filesystem 0x%x do not see every opener: %w", path, st.Type, errdefs.ErrUnimplemented)
	}
	switch _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK); {
	case errors.Is(err, unix.EAGAIN):
		return fmt.Errorf("loopdev: %s: %w: %w", path, ErrOpenElsewhere, errdefs.ErrFailedPrecondition)
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
		// fs.leases-enable=0, or a filesystem without leases.
		return fmt.Errorf("loopdev: F_SETLEASE %s: %w: %w", path, err, errdefs.ErrUnimplemented)
	case err != nil:
		return sysErr("F_SETLEASE", path, err)
	}
	// An opener that broke the lease waits for this release (the kernel
	// sends SIGIO, which the Go runtime ignores when nobody asked for it).
	defer func() {
		if _, uerr := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK); uerr != nil && err == nil {
			err = sysErr("F_SETLEASE F_UNLCK", path, uerr)
		}
	}()
	return fn()
}
