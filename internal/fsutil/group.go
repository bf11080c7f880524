package fsutil

import (
	"errors"
	"io/fs"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// ApplyGroup does what kubelet does with a pod's fsGroup to the
// filesystem whose root is dir: the root and everything below belong to
// group gid, readable and writable by it, directories setgid so that new
// files inherit the group. A root already set so is left as it is
// (kubelet's OnRootMismatch). The walk stays within dir whatever symlinks
// the volume holds (os.Root), and dir may be a magic link to a detached
// mount (/proc/self/fd/N).
func ApplyGroup(dir string, gid uint32) error {
	r, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer r.Close()
	fi, err := r.Stat(".")
	if err != nil {
		return err
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Gid == gid && st.Mode&unix.S_ISGID != 0 && st.Mode&0o070 == 0o070 {
		return nil
	}
	return fs.WalkDir(r.FS(), ".", func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := r.Lchown(p, -1, int(gid)); err != nil {
			return err
		}
		if e.Type()&fs.ModeSymlink != 0 {
			return nil
		}
		fi, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil // gone meanwhile
		}
		if err != nil {
			return err
		}
		mode := fi.Mode() | 0o060
		if fi.IsDir() {
			mode |= 0o010 | fs.ModeSetgid
		} else if mode&0o100 != 0 {
			mode |= 0o010
		}
		return r.Chmod(p, mode)
	})
}
