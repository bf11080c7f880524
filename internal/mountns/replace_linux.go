package mountns

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// moveMountBeneath is MOVE_MOUNT_BENEATH (Linux 6.5): attach a mount
// beneath the top mount of a stack instead of on top of it.
const moveMountBeneath = 0x200

// beneathFlag is moveMountBeneath; a test makes it a flag the kernel refuses,
// to take the other way.
var beneathFlag = moveMountBeneath

// AttachBeneath attaches the detached mount fd beneath the mount on top
// at target (an O_PATH file of that mount's root), at the same mount
// point. Where the kernel refuses (before Linux 6.5, or under a shared
// parent whose propagation it would have to repeat) the error wraps
// unix.EINVAL.
func AttachBeneath(fd, target *os.File) error {
	err := unix.MoveMount(int(fd.Fd()), "", int(target.Fd()), "",
		unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH|beneathFlag)
	runtime.KeepAlive(fd)
	runtime.KeepAlive(target)
	if err != nil {
		return &OpError{Op: "move_mount (beneath)", Path: target.Name(), Err: err}
	}
	return nil
}

// AttrOf maps the per-mount options of a mount table line (field 6 of
// mountinfo: "ro,nosuid,nodev,relatime") to the attributes that give a
// new mount the same ones (mount_setattr), propagation private.
func AttrOf(perMount string) *unix.MountAttr {
	attr := &unix.MountAttr{Propagation: unix.MS_PRIVATE}
	for _, opt := range strings.Split(perMount, ",") {
		if a, ok := mountAttrs[opt]; ok {
			attr.Attr_set |= a
			continue
		}
		if mode, ok := atimeModes[opt]; ok {
			attr.Attr_set = attr.Attr_set&^unix.MOUNT_ATTR__ATIME | mode
			attr.Attr_clr = unix.MOUNT_ATTR__ATIME
			continue
		}
		if opt == "ro" {
			attr.Attr_set |= unix.MOUNT_ATTR_RDONLY
		}
	}
	return attr
}

// CloneBelow clones the directory (or file) rel below dir, an open mount
// root, as a detached mount with attr (OPEN_TREE_CLONE, not recursive).
// rel is resolved beneath dir without following a symlink and without
// leaving dir's mount: whoever writes into the file system under dir (a
// FUSE volume's users) cannot lead the clone elsewhere. rel "" or "/" is
// dir itself.
func CloneBelow(dir *os.File, rel string, attr *unix.MountAttr) (_ *os.File, err error) {
	from := dir
	if rel = strings.Trim(rel, "/"); rel != "" {
		fd, err := Openat2(int(dir.Fd()), rel, unix.O_PATH, 0, ResolveBelowSameMount)
		runtime.KeepAlive(dir)
		if err != nil {
			return nil, Classify(&os.PathError{Op: "openat2", Path: dir.Name() + "/" + rel, Err: err})
		}
		from = os.NewFile(uintptr(fd), dir.Name()+"/"+rel)
		defer from.Close()
	}
	fd, err := unix.OpenTree(int(from.Fd()), "", unix.AT_EMPTY_PATH|unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	runtime.KeepAlive(from)
	if errors.Is(err, unix.ENOSYS) {
		return nil, errNoNewAPI("open_tree")
	}
	if err != nil {
		return nil, &OpError{Op: "open_tree", Path: from.Name(), Err: err}
	}
	f := os.NewFile(uintptr(fd), "clone:"+from.Name())
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if err := unix.MountSetattr(int(f.Fd()), "", unix.AT_EMPTY_PATH, attr); err != nil {
		return nil, &OpError{Op: "mount_setattr", Path: from.Name(), Err: err}
	}
	return f, nil
}

// ReplaceAt puts the detached mount fd in place of the mount on top at
// target (an O_PATH file of that mount's root, opened inside Do), at the
// same mount point. It attaches fd beneath the old mount and then detaches
// the old one, so the mount point never shows what lies under it. Where
// the kernel refuses a mount beneath (before Linux 6.5, or under a shared
// parent whose propagation it would have to repeat), the old mount is
// detached first and fd attached on what reopen finds at the mount point
// then: in between, for a moment, the mount point shows the directory
// underneath. beneath reports which way was taken. Call it inside Do.
func (n *Namespace) ReplaceAt(fd, target *os.File, reopen func() (*os.File, error)) (beneath bool, err error) {
	err = AttachBeneath(fd, target)
	if err == nil {
		return true, n.UnmountAt(target)
	}
	if !errors.Is(err, unix.EINVAL) {
		return false, err
	}
	if err := n.UnmountAt(target); err != nil {
		return false, err
	}
	under, err := reopen()
	if err != nil {
		return false, fmt.Errorf("after detaching the old mount: %w", err)
	}
	defer under.Close()
	return false, AttachAt(fd, under)
}

// UnmountAt detaches (MNT_DETACH) the mount on top at f's place, an open
// file, without resolving a path that the namespace's processes could
// change under it: it unmounts through the magic link /proc/<tid>/fd/<fd>
// of the caller's own /proc. Call it inside Do.
func (n *Namespace) UnmountAt(f *os.File) error {
	name := strconv.Itoa(int(f.Fd()))
	var err error
	if n.self || n.proc == nil {
		err = unix.Unmount("/proc/thread-self/fd/"+name, unix.MNT_DETACH)
	} else {
		// The namespace's own /proc (if any) belongs to another PID
		// namespace, where this thread does not exist: walk from the
		// caller's /proc as the current directory instead. Do's thread
		// has a current directory of its own (unshare(CLONE_FS)) and dies
		// with its goroutine.
		err = n.inProcFds(func() error { return unix.Unmount(name, unix.MNT_DETACH) })
	}
	runtime.KeepAlive(f)
	if err != nil {
		return &OpError{Op: "umount2", Path: f.Name(), Err: err}
	}
	return nil
}

func (n *Namespace) inProcFds(fn func() error) error {
	fd, err := unix.Openat(int(n.proc.Fd()), "thread-self/fd", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	runtime.KeepAlive(n.proc)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fchdir(fd); err != nil {
		return err
	}
	return fn()
}
