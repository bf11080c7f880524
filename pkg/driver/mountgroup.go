package driver

// VOLUME_MOUNT_GROUP: kubelet hands a pod's fsGroup to the driver
// (volume_capability.mount.volume_mount_group) instead of changing the
// ownership of the published directory itself. That matters in NRI mode,
// where kubelet would only reach the guard: the driver gives the volume's
// filesystem to the group, as kubelet would, at publish time.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/source/fuse"
)

// parseMountGroup reads volume_mount_group: a numeric group ID, or empty.
func parseMountGroup(s string) (gid uint32, set bool, err error) {
	if s == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false, invalid("volume_mount_group %q must be a numeric group ID", s)
	}
	return uint32(n), true, nil
}

// applyMountGroupAt gives the filesystem mounted at root to the
// capability's mount group.
func (d *Driver) applyMountGroupAt(ctx context.Context, v *journal.Volume, c capability, readOnly bool, root string) error {
	if !c.mountGroupSet || c.block || readOnly || v.Type == fuse.Type {
		return nil
	}
	if err := applyMountGroup(root, c.mountGroup); err != nil {
		return fmt.Errorf("giving volume %s to group %d (fsGroup): %w", v.ID, c.mountGroup, err)
	}
	klog.FromContext(ctx).V(2).Info("Applied the mount group", "volume", v.ID, "gid", c.mountGroup)
	return nil
}

// applyMountGroup gives v's filesystem to the capability's mount group, on
// a mount of its plan in a mount namespace of its own, which ends with the
// call: the same whether kubelet's target holds the volume (published the
// classic way, by the mounter, maybe out of the plugin's sight) or a
// guard (NRI mode).
func (d *Driver) applyMountGroup(ctx context.Context, v *journal.Volume, c capability, readOnly bool) error {
	if !c.mountGroupSet || c.block || readOnly || v.Type == fuse.Type {
		return nil
	}
	mounts, err := d.planFor(v, source.PlanRequest{MountFlags: c.mountFlags})
	if err != nil {
		return err
	}
	scratch := filepath.Join(d.opts.StateDir, "mountgroup", v.ID)
	if err := os.MkdirAll(scratch, 0o700); err != nil {
		return err
	}
	defer os.Remove(scratch)
	return withPrivateMount(scratch, mounts, func() error { return d.applyMountGroupAt(ctx, v, c, readOnly, scratch) })
}

// withPrivateMount performs mounts at dir in a new mount namespace on a
// thread of its own, runs fn there, and lets the thread end: the kernel
// drops the namespace and its mounts with it, and nothing ever shows in
// the plugin's namespace.
func withPrivateMount(dir string, mounts []plan.Mount, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread, in its own namespace, must not run
		// anything else, and ends with this goroutine.
		runtime.LockOSThread()
		errc <- func() error {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return mountns.Classify(&os.SyscallError{Syscall: "unshare(CLONE_NEWNS)", Err: err})
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return &os.PathError{Op: "make rprivate", Path: "/", Err: err}
			}
			for _, m := range mounts {
				fd, err := mountns.Build(m)
				if err != nil {
					return err
				}
				err = mountns.Attach(fd, path.Join(dir, m.Target))
				fd.Close()
				if err != nil {
					return err
				}
			}
			return fn()
		}()
	}()
	return <-errc
}

// applyMountGroup does what kubelet does with an fsGroup: the root and
// everything below belong to group gid, readable and writable by it,
// directories setgid so that new files inherit the group. A root already
// set so is left as it is (kubelet's OnRootMismatch). The walk stays
// within root whatever symlinks the volume holds.
func applyMountGroup(root string, gid uint32) error {
	var st unix.Stat_t
	if err := unix.Lstat(root, &st); err != nil {
		return &os.PathError{Op: "lstat", Path: root, Err: err}
	}
	if st.Gid == gid && st.Mode&unix.S_ISGID != 0 && st.Mode&0o070 == 0o070 {
		return nil
	}
	r, err := os.OpenRoot(root)
	if err != nil {
		return err
	}
	defer r.Close()
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
