package fsutil

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// maxGroupDepth bounds the directory levels ApplyGroup descends (each
// holds a descriptor open while its entries are walked); kubelet's own
// walk, by path, stops at PATH_MAX, about as deep.
const maxGroupDepth = 2048

// groupResolve is how ApplyGroup opens each entry below its root: never
// through a symlink (a container writes the volume) and never onto another
// mount (RESOLVE_NO_XDEV: an entry that is a mount point is refused with
// EXDEV, so a mount planted inside the volume, another volume's secrets or
// a host directory, is left as it is).
const groupResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// ApplyGroup does what kubelet does with a pod's fsGroup to the
// filesystem whose root is dir: the root and everything below belong to
// group gid, readable and writable by it, directories setgid so that new
// files inherit the group. A root already set so is left as it is
// (kubelet's OnRootMismatch). dir may be a magic link to a detached mount
// (/proc/self/fd/N).
//
// The walk goes by descriptor and stays on dir's own mount: it follows no
// symlink (a symlink gets the group itself, its target nothing), and
// leaves every mount below dir untouched.
func ApplyGroup(dir string, gid uint32) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dir, Err: err}
	}
	root := os.NewFile(uintptr(fd), dir)
	defer root.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return &os.PathError{Op: "fstat", Path: dir, Err: err}
	}
	if st.Gid == gid && st.Mode&unix.S_ISGID != 0 && st.Mode&0o070 == 0o070 {
		return nil
	}
	if err := groupEntry(fd, dir, gid); err != nil {
		return err
	}
	return groupDir(root, gid, 1)
}

// groupDir gives every entry of the open directory d to gid, and descends
// into its directories.
func groupDir(d *os.File, gid uint32, depth int) error {
	if depth > maxGroupDepth {
		return fmt.Errorf("%s: directories nested deeper than %d: %w", d.Name(), maxGroupDepth, errdefs.ErrInvalidArgument)
	}
	for {
		names, err := d.Readdirnames(1024)
		for _, name := range names {
			if err := groupChild(d, name, gid, depth); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// groupChild gives the entry name of d to gid: a directory opened for
// reading (and walked), anything else as an O_PATH descriptor, which
// opens no device and blocks on no FIFO.
func groupChild(d *os.File, name string, gid uint32, depth int) error {
	p := d.Name() + "/" + name
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: groupResolve}
	fd, err := unix.Openat2(int(d.Fd()), name, &how)
	switch {
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOENT):
		return nil // another mount's root (left alone), or gone meanwhile
	case err != nil:
		return &os.PathError{Op: "openat2", Path: p, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return &os.PathError{Op: "fstat", Path: p, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		err := groupEntry(fd, p, gid)
		unix.Close(fd)
		return err
	}
	unix.Close(fd)
	how.Flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	dfd, err := unix.Openat2(int(d.Fd()), name, &how)
	switch {
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.ELOOP):
		return nil // swapped since: a mount, gone, or no directory now
	case err != nil:
		return &os.PathError{Op: "openat2", Path: p, Err: err}
	}
	sub := os.NewFile(uintptr(dfd), p)
	defer sub.Close()
	if err := groupEntry(dfd, p, gid); err != nil {
		return err
	}
	return groupDir(sub, gid, depth+1)
}

// groupEntry gives the file open as fd to gid: the group, read and write
// for it, execute where the owner has it, and setgid on a directory. A
// symlink gets the group only: its mode means nothing, and a chmod would
// reach its target. The mode is read after the chown, which clears a
// file's setuid and setgid bits, as kubelet's walk leaves them.
func groupEntry(fd int, p string, gid uint32) error {
	if err := unix.Fchownat(fd, "", -1, int(gid), unix.AT_EMPTY_PATH); err != nil {
		return &os.PathError{Op: "chown", Path: p, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return &os.PathError{Op: "fstat", Path: p, Err: err}
	}
	typ := st.Mode & unix.S_IFMT
	if typ == unix.S_IFLNK {
		return nil
	}
	mode := st.Mode&0o7777 | 0o060
	if typ == unix.S_IFDIR {
		mode |= 0o010 | unix.S_ISGID
	} else if mode&0o100 != 0 {
		mode |= 0o010
	}
	// Through the descriptor's magic link: an O_PATH descriptor takes no
	// fchmod, and the link leads to this very inode, whatever the name
	// points to now.
	if err := unix.Chmod(fmt.Sprintf("/proc/self/fd/%d", fd), mode); err != nil {
		return &os.PathError{Op: "chmod", Path: p, Err: err}
	}
	return nil
}
