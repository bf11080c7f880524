package mountns

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Root is a directory below which a consumer's paths are resolved through
// file descriptors (openat2), never following a symlink: a container
// controls every directory of its file system, and a symlink it planted in
// a mount point's parents must not lead a mount elsewhere. Open a Root in
// the namespace the paths belong to (inside Namespace.Do).
//
// Root or os.Root: a Root for every path an untrusted party may have
// shaped (a container's tree, the state dir the plugin writes, kubelet's
// directories) and whatever is opened to mount, attach or check; an
// os.Root (which follows symlinks as long as they stay inside it) only for
// the standard library's tree operations on a tree whose every file is
// the caller's to change, reached through a descriptor (RemoveAll of a
// daemon's scratch directory found through a Root; fsGroup's walk of a
// volume's private, detached mount).
type Root struct {
	f    *os.File
	path string
}

// OpenRoot opens dir, a clean absolute path, as a Root. dir itself is
// resolved as usual: it is the namespace's root or a directory the admin
// named (kubelet's).
func OpenRoot(dir string) (*Root, error) {
	if !plan.IsCleanAbs(dir) {
		return nil, fmt.Errorf("root %q must be a clean absolute path: %w", dir, errdefs.ErrInvalidArgument)
	}
	f, err := openFile(dir, unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return nil, Classify(err)
	}
	return &Root{f: f, path: dir}, nil
}

// Close releases the root.
func (r *Root) Close() error { return r.f.Close() }

// rel returns p (absolute, clean, at or below the root) relative to it.
func (r *Root) rel(p string) (string, error) {
	if !plan.IsCleanAbs(p) || !plan.Within(r.path, p) {
		return "", fmt.Errorf("%s is not below %s: %w", p, r.path, errdefs.ErrInvalidArgument)
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(p, r.path), "/")
	if rel == "" {
		rel = "."
	}
	return rel, nil
}

// Open opens p (absolute, at or below the root) with O_PATH. A path with a
// symlink in it is errdefs.ErrPermissionDenied; one that does not exist
// wraps fs.ErrNotExist and errdefs.ErrNotFound.
func (r *Root) Open(p string) (*os.File, error) {
	rel, err := r.rel(p)
	if err != nil {
		return nil, err
	}
	return r.openat(r.f, rel, p, unix.O_PATH)
}

// OpenFile opens p (absolute, at or below the root) with flags (O_RDONLY,
// O_RDWR, O_DIRECT, ...; O_CLOEXEC is added), resolved as Open resolves.
func (r *Root) OpenFile(p string, flags int) (*os.File, error) {
	rel, err := r.rel(p)
	if err != nil {
		return nil, err
	}
	return r.openat(r.f, rel, p, flags)
}

// File is the root's O_PATH descriptor (owned by the Root).
func (r *Root) File() *os.File { return r.f }

// Path is the root's directory, as it was given.
func (r *Root) Path() string { return r.path }

func (r *Root) openat(dir *os.File, rel, full string, flags int) (*os.File, error) {
	fd, err := Openat2(int(dir.Fd()), rel, flags, 0, ResolveBelow)
	runtime.KeepAlive(dir)
	switch {
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("%s leads through a symlink (or out of %s), which is never followed: %w", full, r.path, errdefs.ErrPermissionDenied)
	case errors.Is(err, unix.ENOSYS):
		return nil, fmt.Errorf("openat2 %s: the kernel lacks openat2 (Linux 5.6+): %w", full, errdefs.ErrFailedPrecondition)
	case err != nil:
		return nil, Classify(&os.PathError{Op: "openat2", Path: full, Err: err})
	}
	return os.NewFile(uintptr(fd), full), nil
}

// MkdirAll makes p and its missing parents below the root, each created
// with mkdirat in the directory just opened (p itself an empty file when
// file is set), and returns what it created, parents first. A symlink on
// the way is errdefs.ErrPermissionDenied, as in Open.
func (r *Root) MkdirAll(p string, file bool) (created []string, err error) {
	rel, err := r.rel(p)
	if err != nil || rel == "." {
		return nil, err
	}
	dir, err := r.openat(r.f, ".", r.path, unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	defer func() { dir.Close() }()
	parts := strings.Split(rel, "/")
	for i, name := range parts {
		full := path.Join(r.path, strings.Join(parts[:i+1], "/"))
		last := i == len(parts)-1
		next, err := r.openat(dir, name, full, unix.O_PATH)
		if errors.Is(err, fs.ErrNotExist) {
			if err := makeAt(dir, name, full, file && last); err != nil {
				return created, err
			}
			created = append(created, full)
			next, err = r.openat(dir, name, full, unix.O_PATH)
		}
		if err != nil {
			return created, err
		}
		dir.Close()
		dir = next
	}
	return created, nil
}

// makeAt creates name in dir: a directory, or an empty file, never through
// a symlink (O_EXCL|O_NOFOLLOW).
func makeAt(dir *os.File, name, full string, file bool) error {
	var err error
	if file {
		var fd int
		fd, err = unix.Openat(int(dir.Fd()), name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_WRONLY|unix.O_CLOEXEC, 0o640)
		if err == nil {
			unix.Close(fd)
		}
	} else {
		err = unix.Mkdirat(int(dir.Fd()), name, 0o750)
	}
	runtime.KeepAlive(dir)
	if err != nil {
		return Classify(&os.PathError{Op: "create", Path: full, Err: err})
	}
	return nil
}

// Remove removes p (a directory, which must be empty, or a file) from its
// parent, opened below the root without following a symlink: never
// recursively, never through a link. A p that does not exist is no error.
func (r *Root) Remove(p string) error {
	parent, name, err := r.parentOf(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove %s: %w", p, err)
	}
	defer parent.Close()
	err = unix.Unlinkat(int(parent.Fd()), name, unix.AT_REMOVEDIR)
	if errors.Is(err, unix.ENOTDIR) {
		err = unix.Unlinkat(int(parent.Fd()), name, 0)
	}
	runtime.KeepAlive(parent)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return Classify(&os.PathError{Op: "remove", Path: p, Err: err})
}

// parentOf opens the directory p lies in, below the root without a
// symlink, and names p in it.
func (r *Root) parentOf(p string) (*os.File, string, error) {
	if p == r.path {
		return nil, "", fmt.Errorf("%s is the root: %w", p, errdefs.ErrInvalidArgument)
	}
	parent, err := r.Open(path.Dir(p))
	if err != nil {
		return nil, "", err
	}
	return parent, path.Base(p), nil
}

// Lstat stats p itself (a symlink at p is not followed), found below the
// root as Open finds its parent.
func (r *Root) Lstat(p string) (unix.Stat_t, error) {
	var st unix.Stat_t
	parent, name, err := r.parentOf(p)
	if err != nil {
		return st, err
	}
	defer parent.Close()
	if err := unix.Fstatat(int(parent.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st, Classify(&os.PathError{Op: "lstat", Path: p, Err: err})
	}
	return st, nil
}

// Create makes p, a directory or (file) an empty regular file, in its
// parent found below the root, and reports whether it made it: an entry
// already there is no error (the caller looks at what it is).
func (r *Root) Create(p string, file bool) (created bool, err error) {
	parent, name, err := r.parentOf(p)
	if err != nil {
		return false, err
	}
	defer parent.Close()
	err = makeAt(parent, name, p, file)
	if errors.Is(err, fs.ErrExist) {
		return false, nil
	}
	return err == nil, err
}

// RemoveIfEmpty removes p only while it holds nothing: an empty directory,
// an empty regular file or a device node. Anything else (a file written
// to, a symlink, a directory with entries) stays, and so does a p that is
// gone: neither is an error.
func (r *Root) RemoveIfEmpty(p string) error {
	parent, name, err := r.parentOf(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer parent.Close()
	dfd := int(parent.Fd())
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return Classify(&os.PathError{Op: "lstat", Path: p, Err: err})
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		err = unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR)
		if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
			return nil
		}
	case unix.S_IFREG:
		if st.Size != 0 {
			return nil
		}
		err = unix.Unlinkat(dfd, name, 0)
	case unix.S_IFBLK, unix.S_IFCHR:
		err = unix.Unlinkat(dfd, name, 0)
	default:
		return nil
	}
	runtime.KeepAlive(parent)
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return Classify(&os.PathError{Op: "remove", Path: p, Err: err})
	}
	return nil
}

// AttachAt attaches the detached mount fd onto target, an O_PATH file
// (Root.Open): exactly where target was resolved, whatever its path shows
// by now.
func AttachAt(fd, target *os.File) error {
	err := unix.MoveMount(int(fd.Fd()), "", int(target.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
	runtime.KeepAlive(fd)
	runtime.KeepAlive(target)
	if errors.Is(err, unix.ENOSYS) {
		return errNoNewAPI("move_mount")
	}
	if err != nil {
		return &OpError{Op: "move_mount", Path: target.Name(), Err: err}
	}
	return nil
}

// PathOf returns the path of the open file f as the calling thread's
// namespace sees it (inside Do: this namespace, from its root): the path
// the mount table shows, with no symlink in it. It reads the caller's
// /proc through the handle opened before entering.
func (n *Namespace) PathOf(f *os.File) (string, error) {
	name := fmt.Sprintf("thread-self/fd/%d", f.Fd())
	var p string
	var err error
	if n.proc == nil {
		p, err = os.Readlink("/proc/" + name)
	} else {
		p, err = readlinkat(n.proc, name)
	}
	runtime.KeepAlive(f)
	if err != nil {
		return "", fmt.Errorf("path of %s: %w", f.Name(), err)
	}
	if !plan.IsCleanAbs(p) {
		return "", fmt.Errorf("path of %s is %q, outside this namespace's root: %w", f.Name(), p, errdefs.ErrPermissionDenied)
	}
	return p, nil
}

func readlinkat(dir *os.File, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(int(dir.Fd()), name, buf)
	runtime.KeepAlive(dir)
	if err != nil {
		return "", &os.PathError{Op: "readlinkat", Path: name, Err: err}
	}
	return string(buf[:n]), nil
}

// SubTree returns a detached mount of the directory sub (relative, clean)
// of the detached mount mnt: a subPath of a volume. sub is resolved below
// mnt's root without following a symlink (the volume's files are its
// users'); missing directories are made with the mode of mnt's root, as
// kubelet makes a subPath. sub naming anything but a directory is
// errdefs.ErrFailedPrecondition.
func SubTree(mnt *os.File, sub string) (*os.File, error) {
	fd, err := unix.Dup(int(mnt.Fd()))
	runtime.KeepAlive(mnt)
	if err != nil {
		return nil, err
	}
	r := &Root{f: os.NewFile(uintptr(fd), mnt.Name()), path: "/"}
	defer r.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(r.f.Fd()), &st); err != nil {
		return nil, err
	}
	p := "/" + sub
	created, err := r.MkdirAll(p, false)
	for _, c := range created {
		if err == nil {
			err = r.chmod(c, st.Mode&0o7777)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("subPath %s: %w", sub, err)
	}
	dir, err := r.OpenFile(p, unix.O_PATH|unix.O_DIRECTORY)
	if errors.Is(err, unix.ENOTDIR) {
		return nil, fmt.Errorf("subPath %s is not a directory: %w", sub, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return nil, fmt.Errorf("subPath %s: %w", sub, err)
	}
	defer dir.Close()
	tree, err := unix.OpenTree(int(dir.Fd()), "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	runtime.KeepAlive(dir)
	if errors.Is(err, unix.EINVAL) {
		// Cloning from a detached mount came with Linux 6.15.
		return nil, fmt.Errorf("subPath %s: open_tree of a detached mount: %w (Linux 6.15 or later is needed): %w", sub, err, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return nil, &OpError{Op: "open_tree", Path: sub, Err: err}
	}
	return os.NewFile(uintptr(tree), mnt.Name()+":"+sub), nil
}

// chmod sets the mode of p (below the root, never through a symlink).
func (r *Root) chmod(p string, mode uint32) error {
	f, err := r.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Fchmodat(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(int(f.Fd())), mode, 0); err != nil {
		return &os.PathError{Op: "chmod", Path: p, Err: err}
	}
	return nil
}
