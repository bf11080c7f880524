package mountns

import (
	"errors"

	"golang.org/x/sys/unix"
)

// Unmount unmounts what is mounted at path in the caller's mount namespace,
// without following a symlink in its last component. lazy detaches the
// mount now and lets the kernel finish once nothing uses it (MNT_DETACH),
// which also frees a mount whose FUSE daemon died. A path that is not a
// mount point (EINVAL) or does not exist (ENOENT) counts as unmounted, so
// Unmount is idempotent. Other failures are an *OpError for "umount2".
func Unmount(path string, lazy bool) error {
	flags := unix.UMOUNT_NOFOLLOW
	if lazy {
		flags |= unix.MNT_DETACH
	}
	err := unix.Unmount(path, flags)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return &OpError{Op: "umount2", Path: path, Err: err}
}
