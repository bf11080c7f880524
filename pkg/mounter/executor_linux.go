package mounter

import (
	"context"
	"errors"
	"fmt"
	"os"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Mount checks the plan against the policy, builds every mount in the
// mounter's own namespace (where sources and device nodes live), then enters
// the consumer's namespace and attaches them in order. Mounts already in
// place are left as they are; on failure what this call attached is
// unmounted again and what it created is removed.
func (e *Executor) Mount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	if err := checkNotCanceled(ctx); err != nil {
		return err
	}
	if err := c.Validate(); err != nil {
		return err
	}
	if err := e.Policy.Validate(mounts); err != nil {
		return err
	}
	resolved, err := e.resolve(mounts)
	if err != nil {
		return err
	}
	ns, err := openNamespace(ctx, c)
	if err != nil {
		return err
	}
	defer ns.Close()
	guard, err := e.newGuard(ns)
	if err != nil {
		return err
	}
	a, err := build(resolved)
	if err != nil {
		return err
	}
	defer a.close()
	a.ns, a.mountPoint, a.guard = ns, c.MountPoint, guard
	if err := ns.Do(a.attachAll); err != nil {
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
	ns, err := enterForUnmount(ctx, c)
	if ns == nil {
		return err
	}
	defer ns.Close()
	ids := identify(mounts)
	return ns.Do(func() error {
		for i := len(mounts) - 1; i >= 0; i-- {
			if err := unmountIfOurs(ns, targetPath(c.MountPoint, mounts[i].Target), mounts[i], ids[i]); err != nil {
				return fmt.Errorf("mount %d: %w", i, err)
			}
		}
		return e.removeMountPoint(c.MountPoint)
	})
}

// UnmountAll removes every mount at or below the consumer's mount point,
// newest first, whatever it is. It needs no plan, so it works after the
// plugin lost its state; it also removes whatever else was mounted there.
func (e *Executor) UnmountAll(ctx context.Context, c plan.Consumer) error {
	ns, err := enterForUnmount(ctx, c)
	if ns == nil {
		return err
	}
	defer ns.Close()
	return ns.Do(func() error {
		if err := unmountTree(ns, c.MountPoint); err != nil {
			return err
		}
		return e.removeMountPoint(c.MountPoint)
	})
}

// enterForUnmount checks the request and opens the consumer's namespace.
// A nil namespace means there is nothing to do: with a nil error, the
// namespace is gone and the kernel dropped its mounts with it.
func enterForUnmount(ctx context.Context, c plan.Consumer) (*mountns.Namespace, error) {
	if err := checkNotCanceled(ctx); err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	ns, err := openNamespace(ctx, c)
	if gone(c, err) {
		klog.FromContext(ctx).V(2).Info("Consumer's mount namespace is gone; nothing to unmount", "pid", c.PID, "reason", err)
		return nil, nil
	}
	return ns, err
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

// removeMountPoint removes the mount point if so configured. Run inside the
// namespace; a directory that is not empty or still mounted stays.
func (e *Executor) removeMountPoint(p string) error {
	if !e.RemoveMountPoint {
		return nil
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove mount point: %w", mountns.Classify(err))
	}
	return nil
}

// detach unmounts target; a target that is not (or no longer) a mount point
// or does not exist is not an error.
func detach(target string) error {
	return mountns.Unmount(target, false)
}
