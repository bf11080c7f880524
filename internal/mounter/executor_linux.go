package mounter

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Mount checks the consumer and the plan against the policy (devices
// included: see checkDevice), builds every mount in the mounter's own
// namespace (where sources and device nodes live), then enters the
// consumer's namespace and attaches them in order. Mounts already in place
// are left as they are; on failure what this call attached is unmounted
// again and what it created is removed.
func (e *Executor) Mount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	if err := checkNotCanceled(ctx); err != nil {
		return err
	}
	if err := e.admitConsumer(c); err != nil {
		return err
	}
	if err := e.Policy.Validate(mounts); err != nil {
		return err
	}
	srcs, err := e.openSources(mounts)
	defer closeAll(srcs)
	if err != nil {
		return err
	}
	ns, err := openNamespace(ctx, c)
	if err != nil {
		return err
	}
	defer ns.Close()
	if err := admitNamespace(ctx, c, ns); err != nil {
		return err
	}
	if err := e.attrib.admit(c, ns); err != nil {
		return err
	}
	guard, err := e.newGuard(ns)
	if err != nil {
		return err
	}
	defer guard.close()
	a, err := build(mounts, srcs)
	if err != nil {
		return err
	}
	defer a.close()
	if c.SubPath != "" {
		if err := a.narrow(c.SubPath); err != nil {
			return err
		}
	}
	if err := a.idmap(ns); err != nil {
		return err
	}
	a.ns, a.mountPoint, a.guard = ns, c.MountPoint, guard
	done, err := e.recordMount(ctx, c, ns, a)
	if err != nil {
		return err
	}
	err = ns.Do(func() error {
		return e.inRoot(c, func(root *mountns.Root) error {
			a.root = root
			return a.attachAll()
		})
	})
	if err := done(err); err != nil {
		return err
	}
	if logger := klog.FromContext(ctx).V(2); logger.Enabled() {
		logger.Info("Mounted plan", "mountPoint", c.MountPoint, "pid", c.PID,
			"mntNS", ns.Identity(), "mounts", len(mounts), "attached", len(a.attached))
	}
	return nil
}

// Unmount removes the plan's mounts in reverse order, each only if the mount
// on top of its target is the one the plan describes, so a repeated call
// never removes what lay underneath. A namespace that is gone is not an
// error: the kernel dropped its mounts with it.
func (e *Executor) Unmount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	if err := checkTargets(mounts); err != nil {
		return err
	}
	ns, err := e.enterForUnmount(ctx, c)
	if ns == nil {
		return err
	}
	defer ns.Close()
	ids := identify(mounts)
	v, err := e.voucherFor(c, ns, mounts)
	if err != nil {
		return err
	}
	err = ns.Do(func() error {
		return e.inRoot(c, func(root *mountns.Root) error {
			for i := len(mounts) - 1; i >= 0; i-- {
				if err := unmountIfOurs(ns, root, targetPath(c.MountPoint, mounts[i].Target), mounts[i], ids[i], v.of(i)); err != nil {
					return fmt.Errorf("mount %d: %w", i, err)
				}
			}
			return e.removeMountPoint(root, c.MountPoint)
		})
	})
	if err != nil {
		return err
	}
	return v.forget()
}

// UnmountAll removes every mount at or below the consumer's mount point,
// newest first, whatever it is. It needs no plan, so it works after the
// plugin lost its state; it also removes whatever else was mounted there.
func (e *Executor) UnmountAll(ctx context.Context, c plan.Consumer) error {
	ns, err := e.enterForUnmount(ctx, c)
	if ns == nil {
		return err
	}
	defer ns.Close()
	return ns.Do(func() error {
		return e.inRoot(c, func(root *mountns.Root) error {
			if err := unmountTree(ns, root, c.MountPoint); err != nil {
				return err
			}
			return e.removeMountPoint(root, c.MountPoint)
		})
	})
}

// enterForUnmount checks the request and opens the consumer's namespace.
// A nil namespace means there is nothing to do: with a nil error, the
// namespace is gone and the kernel dropped its mounts with it.
func (e *Executor) enterForUnmount(ctx context.Context, c plan.Consumer) (*mountns.Namespace, error) {
	if err := checkNotCanceled(ctx); err != nil {
		return nil, err
	}
	if err := e.admitConsumer(c); err != nil {
		return nil, err
	}
	ns, err := openNamespace(ctx, c)
	if gone(c, err) {
		klog.FromContext(ctx).V(2).Info("Consumer's mount namespace is gone; nothing to unmount", "pid", c.PID, "reason", err)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if err := admitNamespace(ctx, c, ns); err != nil {
		ns.Close()
		return nil, err
	}
	if err := e.attrib.admit(c, ns); err != nil {
		ns.Close()
		return nil, err
	}
	return ns, nil
}

// hostNS names the host's mount namespace: the one of PID 1 in the host's
// PID namespace, which the mounter shares (hostPID). A variable only so
// that a test can play the host with a namespace of its own.
var hostNS = "/proc/1/ns/mnt"

// admitNamespace refuses a consumer named by a PID whose namespace is the
// mounter's own or the host's: mounts there would reach the host. The
// mounter's own namespace is reached only as PID 0, whose mount points
// admitConsumer keeps below the kubelet dir.
func admitNamespace(ctx context.Context, c plan.Consumer, ns *mountns.Namespace) error {
	if c.PID == 0 {
		return nil
	}
	which, err := hostSide(ctx, ns)
	if err != nil {
		return fmt.Errorf("%w, to tell it from pid %d's", err, c.PID)
	}
	if which != "" {
		return fmt.Errorf("pid %d is in %s mount namespace: %w", c.PID, which, errdefs.ErrPermissionDenied)
	}
	return nil
}

// hostSide names ns when it is the mounter's own ("the mounter's own") or
// the host's ("the host's") mount namespace, and is "" for any other. When
// the host's namespace cannot be read (a sandbox that hides PID 1 even
// from root), only the mounter's own is recognised, and the log says so.
func hostSide(ctx context.Context, ns *mountns.Namespace) (string, error) {
	if ns.IsSelf() {
		return "the mounter's own", nil
	}
	var host unix.Stat_t
	err := unix.Stat(hostNS, &host)
	switch {
	case errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM):
		klog.FromContext(ctx).V(2).Info("Cannot read the host's mount namespace; only the mounter's own is recognised", "path", hostNS, "err", err)
	case err != nil:
		return "", fmt.Errorf("the host's mount namespace (%s): %w", hostNS, err)
	case host.Ino == ns.Inode():
		return "the host's", nil
	}
	return "", nil
}

// openSources opens the source of every mount of the plan, checked: a
// block device the mounter set up (the source of a filesystem, or a bind
// of a device node under /dev), or a bind source the mounter made below
// the state dir (sourceChecker). Mounts without a source (tmpfs) get nil.
// A plan with path-valued options (overlay's lowerdir=...) is refused: a
// path there is resolved by the kernel when the mount is built, after any
// check, and the plugin writes the directories it would name; a chain is
// bound from the overlay the mounter made instead. On error the files
// opened so far are returned too, to close.
func (e *Executor) openSources(mounts []plan.Mount) ([]*os.File, error) {
	files := make([]*os.File, len(mounts))
	for i, m := range mounts {
		if plan.HasPathOptions(m) {
			return files, fmt.Errorf("mount %d: %s mount with a path-valued option: the mounter takes no host path but a plan's source: %w", i, m.Type, errdefs.ErrPermissionDenied)
		}
		if m.Type == "tmpfs" {
			continue
		}
		if e.sources == nil {
			return files, fmt.Errorf("mount %d: this executor has no record of the devices and mounts it may use: %w", i, errdefs.ErrPermissionDenied)
		}
		var err error
		switch {
		case m.Type != plan.TypeBind, plan.Within("/dev", m.Source):
			files[i], err = e.sources.openDevice(m.Source)
		default:
			files[i], err = e.sources.openBindSource(m.Source)
		}
		if err != nil {
			return files, fmt.Errorf("mount %d: %w", i, err)
		}
	}
	return files, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}

// openNamespace opens the consumer's namespace. Its PID may no longer name
// it: the process exited (a container's first process, while others live
// on) or the PID was reused. When the namespace's never-reused ID is known,
// it is then found and entered through any process still in it, and only
// when none is left does this fail with errdefs.ErrNotFound. With no ID
// (an older kernel, a caller that did not keep it) the PID is all there is,
// and an inode alone could name an unrelated namespace that got it after
// the consumer's died.
func openNamespace(ctx context.Context, c plan.Consumer) (*mountns.Namespace, error) {
	want := c.Namespace
	if c.PID == 0 {
		ns, err := mountns.Self()
		if err == nil && !want.Matches(ns.Identity()) {
			ns.Close()
			return nil, fmt.Errorf("mounter runs in mount namespace %s, not %s: %w", ns.Identity(), want, errdefs.ErrFailedPrecondition)
		}
		return ns, err
	}
	ns, err := mountns.OpenPID(c.PID, want)
	if err == nil || want.ID == 0 || !(errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrFailedPrecondition)) {
		return ns, err
	}
	ns, ferr := mountns.OpenIdentity(want)
	if ferr != nil {
		// Only ferr is wrapped: err says nothing of whether the namespace
		// lives, and gone() must not take an unreadable /proc for "gone".
		return nil, fmt.Errorf("%v; %w", err, ferr)
	}
	klog.FromContext(ctx).V(2).Info("Consumer's process no longer names its mount namespace; entered it through another process",
		"pid", c.PID, "reason", err, "mntNS", want)
	return ns, nil
}

// inRoot runs fn with the root below which c's paths are resolved
// (mountns.Root: through file descriptors, never following a symlink): the
// namespace's root for a container, the kubelet dir for the mounter's own
// namespace. Run inside the namespace.
func (e *Executor) inRoot(c plan.Consumer, fn func(*mountns.Root) error) error {
	dir := "/"
	if c.PID == 0 {
		dir = e.kubeletRoot(c.MountPoint) // admitConsumer made sure there is one
	}
	root, err := mountns.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	return fn(root)
}

// removeMountPoint removes the mount point if so configured. Run inside the
// namespace; a directory that is not empty or still mounted stays.
func (e *Executor) removeMountPoint(root *mountns.Root, p string) error {
	if !e.RemoveMountPoint {
		return nil
	}
	if err := root.Remove(p); err != nil {
		return fmt.Errorf("remove mount point: %w", err)
	}
	return nil
}

// detach unmounts target; a target that is not (or no longer) a mount point
// or does not exist is not an error.
func detach(target string) error {
	return mountns.Unmount(target, false)
}
