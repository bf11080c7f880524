package mountns

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// nsGetUserNS is NS_GET_USERNS (linux/nsfs.h, _IO(0xb7, 0x1)): the user
// namespace that owns a namespace, as a new fd. x/sys/unix lacks it.
const nsGetUserNS = 0xb701

// UserNS returns the user namespace that owns the mount namespace when it
// is not the caller's own (a container of a pod with hostUsers: false),
// nil when it is. It is asked of the mount namespace fd the caller holds,
// not of /proc/PID/ns/user: a PID reused since n was opened cannot name
// another process's user namespace.
func (n *Namespace) UserNS() (*os.File, error) {
	if n.self || n.ns == nil {
		return nil, nil
	}
	fd, err := unix.IoctlRetInt(int(n.ns.Fd()), nsGetUserNS)
	if err != nil {
		return nil, &os.PathError{Op: "ioctl NS_GET_USERNS", Path: n.ns.Name(), Err: err}
	}
	userns := os.NewFile(uintptr(fd), "userns of "+n.ns.Name())
	var theirs, own unix.Stat_t
	if err := unix.Fstat(fd, &theirs); err != nil {
		userns.Close()
		return nil, &os.PathError{Op: "fstat", Path: userns.Name(), Err: err}
	}
	if err := unix.Stat("/proc/thread-self/ns/user", &own); err != nil {
		userns.Close()
		return nil, &os.PathError{Op: "stat", Path: "/proc/thread-self/ns/user", Err: err}
	}
	if theirs.Dev == own.Dev && theirs.Ino == own.Ino {
		userns.Close()
		return nil, nil
	}
	return userns, nil
}

// IDMap makes a detached mount (Build's) an idmapped mount of userns: a
// file the filesystem says is uid U appears as the uid userns maps U to,
// so that root of the user namespace sees its volume's root-owned files as
// its own and writes files owned by root on disk, whatever its range of
// host uids. The filesystem must allow it (ext4, xfs, tmpfs, overlay; FUSE
// only from Linux 6.12 and when its server asks for it): otherwise the
// error wraps errdefs.ErrFailedPrecondition and names the filesystem.
func IDMap(mnt, userns *os.File, fsType string) error {
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns.Fd())}
	err := unix.MountSetattr(int(mnt.Fd()), "", unix.AT_EMPTY_PATH, &attr)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS):
		// EINVAL: the filesystem does not allow idmapped mounts (FS_ALLOW_IDMAP
		// unset, or a FUSE server that did not ask for them).
		return fmt.Errorf("%w: a %s filesystem cannot be idmapped to the container's user namespace here (the pod has hostUsers: false; its root would see the files owned by nobody): %w",
			&OpError{Op: "mount_setattr", FSType: fsType, Path: mnt.Name(), Err: err}, fsType, errdefs.ErrFailedPrecondition)
	default:
		return &OpError{Op: "mount_setattr", FSType: fsType, Path: mnt.Name(), Err: err}
	}
}
