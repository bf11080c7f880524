package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"path/filepath"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Executor performs plans in process. It keeps no state between calls: what
// is mounted is read from the kernel every time, so calls are idempotent and
// a restarted mounter picks up where the last one stopped.
type Executor struct {
	// Policy is checked again before every Mount, whatever the plugin
	// already checked: the mounter trusts a plan no more than its own
	// configuration allows. Its zero value allows no host path and no
	// loop device.
	Policy plan.Policy
	// KubeletDir is kubelet's root directory (--kubelet-dir). A consumer
	// in the mounter's own namespace (PID 0: kubelet's publishes, whose
	// mounts reach the host) may only have a mount point below it. Empty:
	// no such consumer is served.
	KubeletDir string
	// RemoveMountPoint makes Unmount and UnmountAll remove the mount point
	// once nothing is mounted on it, with a plain rmdir or unlink, never
	// recursively. The plugin removes kubelet's target_path itself, so it
	// leaves this off; a container's own directory should be left alone.
	RemoveMountPoint bool
	// AllowPropagation lets Mount attach in a consumer's namespace under a
	// shared mount whose propagation reaches the mounter's own or the
	// host's (PID 1) namespace. By default that fails with
	// ErrFailedPrecondition, because the volume would then appear outside
	// the consumer and outlive it. Consumers in the mounter's own or the
	// host's namespace are never checked: kubelet's flow relies on
	// propagation there.
	AllowPropagation bool

	// sources opens and checks a plan's devices and bind sources; Local
	// sets it. Without it every device and bind is refused.
	sources sourceChecker
	// attrib records the namespaces the mounter may enter and what it
	// mounted where, and with Options.Attributed refuses the rest
	// (attribution_linux.go); Local sets it. Nil: nothing is recorded and
	// no namespace or mount is refused for want of a record.
	attrib *attribution
}

var _ Interface = (*Executor)(nil)

// admitConsumer checks c against what every call may name, before its
// namespace is opened: PID 0 (the mounter's own namespace) only below
// KubeletDir, never PID 1 (the host's init). What the namespace of a PID
// turns out to be is checked once it is open (admitNamespace).
func (e *Executor) admitConsumer(c plan.Consumer) error {
	if err := c.Validate(); err != nil {
		return err
	}
	switch {
	case c.PID == 1:
		return fmt.Errorf("consumer pid 1 is the host's init: %w", errdefs.ErrPermissionDenied)
	case c.PID == 0 && e.kubeletRoot(c.MountPoint) == "":
		return fmt.Errorf("mount point %s in the mounter's own namespace is not below the kubelet dir %q: %w",
			c.MountPoint, e.KubeletDir, errdefs.ErrPermissionDenied)
	}
	return nil
}

// kubeletRoot returns the kubelet dir that mount point p lies strictly
// below: KubeletDir as given or, when the admin's path is a symlink (a
// kubelet dir moved to another disk), as resolved. "" when neither. The
// symlinks are resolved only when p is not below the path as given, which
// answers first either way: kubelet's paths, named as configured, cost no
// lstat of every component of the dir twice a Mount and twice an Unmount.
func (e *Executor) kubeletRoot(p string) string {
	if e.KubeletDir == "" {
		return ""
	}
	below := func(d string) bool { return plan.IsCleanAbs(d) && plan.Within(d, p) && p != d }
	if d := filepath.Clean(e.KubeletDir); below(d) {
		return d
	}
	if real, err := filepath.EvalSymlinks(e.KubeletDir); err == nil && below(real) {
		return real
	}
	return ""
}

// checkTargets accepts the targets of a plan that is only to be undone: its
// sources are never opened, so the policy does not apply.
func checkTargets(mounts []plan.Mount) error {
	for i, m := range mounts {
		if err := plan.ValidateTarget(m.Target); err != nil {
			return fmt.Errorf("mount %d: %w", i, err)
		}
	}
	return nil
}

func resolvePath(p string) (string, error) {
	r, err := filepath.EvalSymlinks(p)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	}
	return r, err
}

// targetPath is where a descriptor is attached.
func targetPath(mountPoint, target string) string {
	if target == "" {
		return mountPoint
	}
	return path.Join(mountPoint, target)
}

// gone reports whether an error from opening a consumer's namespace means
// the namespace no longer exists. With its ID known, no process is left in
// it (see openNamespace); without, its process exited or its PID now names
// a process in another namespace, which is all that can be told.
func gone(c plan.Consumer, err error) bool {
	return c.PID != 0 && (errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrFailedPrecondition))
}

func checkNotCanceled(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("mounter: %w", err)
	}
	return nil
}
