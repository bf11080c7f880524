package mountns

import (
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// IsMountPoint reports whether something is mounted at path in the
// caller's mount namespace. The directory part is resolved as the kernel
// resolves it; the last component is not followed, as Unmount does not
// follow it: a symlink there is never a mount point. Two openat2 calls,
// where mountinfo.Mounted first resolves every component with lstat
// (EvalSymlinks) and may fall back to reading the whole mount table: the
// reconciler asks this of every publish on the node each round. A path
// that does not exist fails with an error that wraps fs.ErrNotExist.
func IsMountPoint(path string) (bool, error) {
	path = filepath.Clean(path)
	if path == "/" {
		return true, nil
	}
	dir, last := filepath.Split(path)
	dirfd, err := Openat2(unix.AT_FDCWD, dir, unix.O_PATH, 0, 0)
	if err != nil {
		return false, &os.PathError{Op: "openat2", Path: dir, Err: err}
	}
	defer unix.Close(dirfd)
	return mountedAt(dirfd, last, path)
}

// IsMountPoint reports whether something is mounted at p (absolute,
// strictly below the root), its parent found below the root as Open finds
// it (no symlink followed on the way) and p itself not followed either.
// A p that does not exist fails with an error that wraps fs.ErrNotExist
// and errdefs.ErrNotFound, as the Root's other lookups do.
func (r *Root) IsMountPoint(p string) (bool, error) {
	parent, name, err := r.parentOf(p)
	if err != nil {
		return false, err
	}
	defer parent.Close()
	mounted, err := mountedAt(int(parent.Fd()), name, p)
	return mounted, Classify(err)
}

// mountedAt reports whether name in directory dirfd is a mount point;
// path names it in errors.
func mountedAt(dirfd int, name, path string) (bool, error) {
	// RESOLVE_NO_XDEV fails the lookup with EXDEV exactly when it would
	// step onto another mount: the last component is a mount point.
	fd, err := Openat2(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW, 0, unix.RESOLVE_NO_XDEV)
	switch err {
	case nil:
		unix.Close(fd)
		return false, nil
	case unix.EXDEV:
		return true, nil
	}
	return false, &os.PathError{Op: "openat2", Path: path, Err: err}
}
