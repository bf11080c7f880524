package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/blocking"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// maxNamespaces bounds one LiveNamespaces call.
const maxNamespaces = 4096

// IdentifyNamespace returns the identity of pid's mount namespace.
func (n *Local) IdentifyNamespace(_ context.Context, pid int) (plan.Namespace, error) {
	ns, err := mountns.IdentityOf(pid)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return ns, fmt.Errorf("process %d does not exist: %w", pid, errdefs.ErrNotFound)
	case errors.Is(err, fs.ErrPermission):
		return ns, fmt.Errorf("mount namespace of process %d: %w: %w", pid, err, errdefs.ErrPermissionDenied)
	}
	return ns, err
}

// LiveNamespaces reports, for each consumer, whether a process is still in
// its mount namespace: its own PID, or any other (a container's namespace
// outlives any one of its processes). One whose namespace is unknown is
// not alive; one that cannot be told (an unreadable /proc) is.
func (n *Local) LiveNamespaces(_ context.Context, cs []plan.Consumer) ([]bool, error) {
	if len(cs) > maxNamespaces {
		return nil, fmt.Errorf("%d namespaces asked about at once, more than %d: %w", len(cs), maxNamespaces, errdefs.ErrInvalidArgument)
	}
	out := make([]bool, len(cs))
	for i, c := range cs {
		if c.Namespace.Inode == 0 {
			continue
		}
		if c.PID > 0 {
			if ns, err := mountns.IdentityOf(c.PID); err == nil && c.Namespace.Matches(ns) {
				out[i] = true
				continue
			}
		}
		_, ok, err := mountns.Find(c.Namespace)
		out[i] = ok || err != nil
	}
	return out, nil
}

// StatFS measures the filesystem at c's mount point as c's namespace sees
// it, never leaving the namespace's root whatever symlinks are in it; the
// namespace must still be the one c names. A filesystem that does not
// answer (a hung FUSE daemon) ends it at ctx's deadline, or statFSTimeout;
// the StatFS calls of one consumer's mount point meanwhile (kubelet asks
// every minute) share the one under way (blocking.Shared), which holds a
// slot of the process's blocking calls until the kernel returns.
func (n *Local) StatFS(ctx context.Context, c plan.Consumer) (fsutil.Usage, error) {
	if err := c.Validate(); err != nil {
		return fsutil.Usage{}, err
	}
	if c.PID <= 0 {
		return fsutil.Usage{}, fmt.Errorf("statfs in a namespace needs a consumer pid: %w", errdefs.ErrInvalidArgument)
	}
	// What a namespace nobody vouched for holds is none of the plugin's
	// business (issue 33, F1 and F12): the host's files are not to be
	// probed through it.
	if n.exec.attrib != nil && n.exec.attrib.enforce {
		ns, err := mountns.IdentityOf(c.PID)
		if err != nil {
			return fsutil.Usage{}, err
		}
		if err := n.exec.attrib.admitIdentity(c, ns); err != nil {
			return fsutil.Usage{}, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, statFSTimeout)
	defer cancel()
	key := fmt.Sprintf("statfs\x00%d\x00%s\x00%s", c.PID, c.Namespace, c.MountPoint)
	return blocking.Shared(ctx, key, fmt.Sprintf("statfs of %s in pid %d's namespace", c.MountPoint, c.PID), func() (fsutil.Usage, error) {
		return statFSIn(c)
	})
}

func statFSIn(c plan.Consumer) (fsutil.Usage, error) {
	root, err := unix.Open(filepath.Join("/proc", strconv.Itoa(c.PID), "root"), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fsutil.Usage{}, mountns.Classify(&os.PathError{Op: "open", Path: fmt.Sprintf("/proc/%d/root", c.PID), Err: err})
	}
	defer unix.Close(root)
	if ns, err := mountns.IdentityOf(c.PID); err != nil || !c.Namespace.Matches(ns) {
		return fsutil.Usage{}, fmt.Errorf("pid %d is no longer in mount namespace %s: %w", c.PID, c.Namespace, errdefs.ErrNotFound)
	}
	fd, err := mountns.Openat2(root, c.MountPoint, unix.O_PATH, 0, mountns.ResolveInRoot)
	if err != nil {
		return fsutil.Usage{}, mountns.Classify(&os.PathError{Op: "openat2", Path: c.MountPoint, Err: err})
	}
	defer unix.Close(fd)
	return fsutil.Stats(fmt.Sprintf("/proc/self/fd/%d", fd))
}

// statFSTimeout bounds a StatFS whose caller set no earlier deadline.
const statFSTimeout = 30 * time.Second

// MakeDeviceNode creates at target, below kubelet's directory without
// following a symlink (missing parents made as MakeTarget makes them), a
// block device node of dev, a device the mounter set up: kubelet and the
// runtime see a device there, nothing is mounted.
// An empty regular file (which kubelet or an earlier publish may have
// left) is replaced; anything else is ErrAlreadyExists.
func (n *Local) MakeDeviceNode(_ context.Context, target string, d Device) (bool, error) {
	f, err := n.openDev(d)
	if err != nil {
		return false, err
	}
	f.Close()
	kr, err := n.kubeletTree(target)
	if err != nil {
		return false, err
	}
	defer kr.Close()
	// Its parents are made here, as MakeTarget makes a target's: the
	// plugin sees no kubelet dir to make them in.
	if _, err := kr.MkdirAll(filepath.Dir(target), false); err != nil {
		return false, targetError(target, err)
	}
	parent, err := kr.Open(filepath.Dir(target))
	if err != nil {
		return false, targetError(target, err)
	}
	defer parent.Close()
	dirfd, name, rdev := int(parent.Fd()), filepath.Base(target), unix.Mkdev(d.Major, d.Minor)
	var st unix.Stat_t
	switch err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		return false, &os.PathError{Op: "stat", Path: target, Err: err}
	case st.Mode&unix.S_IFMT == unix.S_IFBLK && uint64(st.Rdev) == rdev: //nolint:unconvert // Rdev is uint32 on some architectures
		return false, nil
	case st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size == 0:
		if err := unix.Unlinkat(dirfd, name, 0); err != nil {
			return false, &os.PathError{Op: "unlink", Path: target, Err: err}
		}
	default:
		return false, fmt.Errorf("%s exists and is not the volume's device node: %w", target, errdefs.ErrAlreadyExists)
	}
	if err := unix.Mknodat(dirfd, name, unix.S_IFBLK|0o600, int(rdev)); err != nil {
		return false, &os.PathError{Op: "mknod", Path: target, Err: err}
	}
	return true, nil
}
