package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/blocking"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The plugin's target paths are made, inspected and removed here, not in
// the plugin: kubelet's directory holds every pod's Secrets and
// ServiceAccount tokens, so the plugin's container does not mount it
// (issue 33, F4). Each call resolves p below kubelet's directory through
// one mountns.Root (openat2 beneath it, no symlink followed), so a symlink
// that whoever can write inside (a pod with a hostPath) plants there leads
// nowhere, not even one planted after a check.
//
// Only "strictly below the kubelet dir" is enforced, not kubelet's own
// target forms (pods/<uid>/volumes/kubernetes.io~csi/<name>/mount,
// plugins/kubernetes.io/csi/...): csi-sanity and the e2e tests publish at
// other paths below the kubelet dir they name.

// kubeletTree opens, as a Root, the kubelet dir that p lies strictly
// below: a p that is not is ErrPermissionDenied (whatever the plugin was
// told, the mounter's own kubelet dir bounds it); a kubelet dir that does
// not exist is ErrNotFound.
func (n *Local) kubeletTree(p string) (*mountns.Root, error) {
	if !plan.IsCleanAbs(p) {
		return nil, fmt.Errorf("target %q is not a clean absolute path: %w", p, errdefs.ErrInvalidArgument)
	}
	dir := n.exec.kubeletRoot(p)
	if dir == "" {
		return nil, fmt.Errorf("target %s is not below the kubelet dir %q: %w", p, n.exec.KubeletDir, errdefs.ErrPermissionDenied)
	}
	root, err := mountns.OpenRoot(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("target %s: the kubelet dir %s does not exist: %w", p, dir, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("kubelet dir: %w", err)
	}
	return root, nil
}

// targetError says what a failed lookup of p below kubelet's directory
// means: a symlink (mountns.Root's ErrPermissionDenied) or a
// non-directory on the way is ErrInvalidArgument, a path kubelet would
// not have made, as the plugin answers a CO's malformed path.
func targetError(p string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errdefs.ErrPermissionDenied), errors.Is(err, unix.ENOTDIR):
		// %s, not %w: the cause's own sentinel is not the answer.
		return fmt.Errorf("target %s passes through a symlink or something not a directory (%s): %w", p, err, errdefs.ErrInvalidArgument)
	}
	return fmt.Errorf("target %s: %w", p, err)
}

// MakeTarget makes the target p and its missing parents below one Root;
// a parent that is not a directory fails the mkdirat with ENOTDIR
// (ErrInvalidArgument, as a symlink on the way is).
func (n *Local) MakeTarget(_ context.Context, p string, block bool) (created bool, err error) {
	root, err := n.kubeletTree(p)
	if err != nil {
		return false, err
	}
	defer root.Close()
	if _, err := root.MkdirAll(filepath.Dir(p), false); err != nil {
		return false, targetError(p, err)
	}
	if created, err = root.Create(p, block); err != nil || created {
		return created, targetError(p, err)
	}
	st, err := root.Lstat(p)
	if err != nil {
		return false, targetError(p, err)
	}
	switch mode := st.Mode & unix.S_IFMT; {
	case mode == unix.S_IFDIR && !block, mode == unix.S_IFREG && block:
		return false, nil
	case mode == unix.S_IFLNK:
		return false, fmt.Errorf("target %s is a symlink: %w", p, errdefs.ErrInvalidArgument)
	default:
		return false, fmt.Errorf("target %s exists and is not a %s: %w", p, map[bool]string{true: "file", false: "directory"}[block], errdefs.ErrInvalidArgument)
	}
}

// TargetState looks whether p is a mount point first: that lookup stops
// at the mount (RESOLVE_NO_XDEV) and never asks a dead FUSE daemon, which
// an lstat of p would. Any other failure of it than a missing path counts
// as mounted.
func (n *Local) TargetState(_ context.Context, p string) (Target, error) {
	root, err := n.kubeletTree(p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return Target{}, nil
	}
	if err != nil {
		return Target{}, err
	}
	defer root.Close()
	mounted, err := root.IsMountPoint(p)
	switch {
	case errors.Is(err, errdefs.ErrPermissionDenied), errors.Is(err, unix.ENOTDIR):
		return Target{}, targetError(p, err)
	case errors.Is(err, fs.ErrNotExist):
		return Target{Parent: parentExists(root, p)}, nil
	case err != nil, mounted:
		return Target{Parent: true, Exists: true, Mounted: true}, nil
	}
	t := Target{Parent: true, Exists: true}
	st, err := root.Lstat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Target{Parent: true}, nil
	case err != nil:
		return t, targetError(p, err)
	case st.Mode&unix.S_IFMT == unix.S_IFBLK:
		t.Device = &Device{Path: p, Major: unix.Major(uint64(st.Rdev)), Minor: unix.Minor(uint64(st.Rdev))} //nolint:unconvert // Rdev is uint32 on some architectures
	}
	return t, nil
}

// parentExists reports whether the directory p lies in is there, reached
// below root without a symlink.
func parentExists(root *mountns.Root, p string) bool {
	dir := filepath.Dir(p)
	if dir == root.Path() {
		return true
	}
	f, err := root.Open(dir)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// RemoveTarget removes p with mountns.Root.RemoveIfEmpty: never
// recursively, never a symlink, never what something was written to; the
// kernel refuses to remove a mount point (EBUSY).
func (n *Local) RemoveTarget(_ context.Context, p string) error {
	root, err := n.kubeletTree(p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	defer root.Close()
	return targetError(p, root.RemoveIfEmpty(p))
}

// StatTarget measures only a mount point: what the rest of kubelet's
// directory holds is none of the plugin's business. A filesystem that
// does not answer (a hung FUSE daemon) ends it at ctx's deadline, or
// statFSTimeout, as StatFS.
func (n *Local) StatTarget(ctx context.Context, p string) (fsutil.Usage, error) {
	ctx, cancel := context.WithTimeout(ctx, statFSTimeout)
	defer cancel()
	// Keyed by the path: kubelet asks for a hung volume's stats every
	// minute, and its retries share the one call under way.
	what := "statfs of target " + p
	return blocking.Shared(ctx, what, what, func() (fsutil.Usage, error) {
		root, err := n.kubeletTree(p)
		if err != nil {
			return fsutil.Usage{}, err
		}
		defer root.Close()
		mounted, err := root.IsMountPoint(p)
		if err != nil {
			return fsutil.Usage{}, targetError(p, err)
		}
		if !mounted {
			return fsutil.Usage{}, fmt.Errorf("nothing is mounted at target %s: %w", p, errdefs.ErrNotFound)
		}
		f, err := root.Open(p)
		if err != nil {
			return fsutil.Usage{}, targetError(p, err)
		}
		defer f.Close()
		return fsutil.Stats(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	})
}
