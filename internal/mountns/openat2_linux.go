package mountns

import (
	"errors"

	"golang.org/x/sys/unix"
)

// How paths are resolved: every openat2 of mountplan goes through Openat2
// with one of these policies.
const (
	// ResolveBelow is a Root's: beneath its directory, no symlink, no
	// magic link (/proc/PID/fd/N), across mounts.
	ResolveBelow = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS
	// ResolveBelowSameMount is ResolveBelow that also stays on the
	// directory's mount: where a user of the file system below writes the
	// directories (a clone of a FUSE volume's subdirectory).
	ResolveBelowSameMount = ResolveBelow | unix.RESOLVE_NO_XDEV
	// ResolveInRoot resolves a path as a process whose root the directory
	// is (a container's /proc/PID/root) sees it: symlinks followed, but
	// never out of that root, and no magic link.
	ResolveInRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS
	// ResolveNoSymlinks resolves an absolute path the admin gave without
	// following any symlink on the way.
	ResolveNoSymlinks = unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS
)

// openat2Tries bounds the retries of a lookup the kernel answers EAGAIN
// (a rename or a mount elsewhere raced with a RESOLVE_BENEATH or
// RESOLVE_IN_ROOT lookup, which it then refuses rather than risk an
// escape) or EINTR.
const openat2Tries = 32

// Openat2 is openat2(2) with flags, mode and resolve, retried on EAGAIN
// and EINTR as runc does. The error is the kernel's, unwrapped.
func Openat2(dirfd int, path string, flags int, mode uint32, resolve uint64) (int, error) {
	how := &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: resolve}
	for i := 1; ; i++ {
		fd, err := unix.Openat2(dirfd, path, how)
		if i < openat2Tries && (errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR)) {
			continue
		}
		return fd, err
	}
}
