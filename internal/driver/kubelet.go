package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
)

// kubeletDir confines the staging and target paths a CO sends to kubelet's
// directory, the way kubelet makes them: a path must lie under it, and no
// directory between the root and the path's last element may be a
// symlink, which whoever can write inside (a pod with a hostPath) could
// point at /etc. A path's parent is resolved by mountns.Root, the
// resolver the mounter uses too (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS),
// and what the plugin creates or removes there it creates or removes
// relative to the parent's descriptor, so a symlink planted after the
// check is not followed either.
type kubeletDir struct {
	root string // clean, absolute, its own symlinks resolved (the admin's)
}

func newKubeletDir(dir string) (kubeletDir, error) {
	if dir == "" {
		dir = config.DefaultKubeletDir
	}
	if !filepath.IsAbs(dir) {
		return kubeletDir{}, fmt.Errorf("kubelet dir %q must be absolute: %w", dir, errdefs.ErrInvalidArgument)
	}
	// The admin's path may itself be a symlink (a kubelet dir moved to
	// another disk); only what lies below it is the CO's.
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	return kubeletDir{root: filepath.Clean(dir)}, nil
}

// rel returns p relative to the root, refusing a path that is not a clean
// absolute path strictly under it.
func (k kubeletDir) rel(name, p string) (string, error) {
	if err := requirePath(name, p); err != nil {
		return "", err
	}
	rel, ok := strings.CutPrefix(p, k.root+"/")
	if k.root == "/" {
		rel, ok = strings.TrimPrefix(p, "/"), p != "/"
	}
	if !ok || rel == "" {
		return "", invalid("%s %q is not under the kubelet directory %s", name, p, k.root)
	}
	return rel, nil
}

// check refuses p unless it lies under the root and every directory of it
// that exists, down to its parent, is reached without a symlink. Missing
// directories are fine: kubelet makes a staging path's parents lazily.
func (k kubeletDir) check(name, p string) error {
	_, err := k.parent(name, p, false)
	if errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, unix.ENOTDIR) {
		return nil
	}
	return err
}

// parent makes sure the directory p lies in is one below kubelet's
// directory reached without a symlink (with create, missing directories
// are made, 0750, as kubelet does) and returns it: a missing one is
// errdefs.ErrNotFound, a symlink or a non-directory on the way
// InvalidArgument.
func (k kubeletDir) parent(name, p string, create bool) (string, error) {
	root, err := k.open(name, p)
	if err != nil {
		return "", err
	}
	defer root.Close()
	dir := filepath.Dir(p)
	if create {
		if _, err := root.MkdirAll(dir, false); err != nil {
			return "", pathError(name, p, err)
		}
	}
	if dir == k.root {
		return dir, nil
	}
	st, err := root.Lstat(dir)
	if err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
		err = unix.ENOTDIR
	}
	if err != nil {
		return "", pathError(name, p, err)
	}
	return dir, nil
}

// checkVolumePath checks a node request's volume ID (its presence first)
// and the path it names in field name (see kubeletDir.check).
func (d *Driver) checkVolumePath(id, name, p string) error {
	if err := requireVolumeID(id); err != nil {
		return err
	}
	return d.kubelet.check(name, p)
}

// checkStaged checks what every request about a staged volume carries:
// its ID, the staging path (under kubelet's directory) and the capability
// it was staged with.
func (d *Driver) checkStaged(id, stagingPath string, vc *csi.VolumeCapability) (capability, error) {
	if err := d.checkVolumePath(id, "staging_target_path", stagingPath); err != nil {
		return capability{}, err
	}
	return checkCapability(vc)
}

// root opens kubelet's directory as a mountns.Root (openat2 below it, no
// symlink followed) for a request's path p, after checking p lies below
// it.
func (k kubeletDir) open(name, p string) (*mountns.Root, error) {
	if _, err := k.rel(name, p); err != nil {
		return nil, err
	}
	root, err := mountns.OpenRoot(k.root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s %q: the kubelet directory %s does not exist: %w", name, p, k.root, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("kubelet directory: %w", err)
	}
	return root, nil
}

// pathError says what a failed lookup of p below kubelet's directory
// means: a symlink or a non-directory on the way is InvalidArgument (the
// CO sent a path kubelet would not have made).
func pathError(name, p string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errdefs.ErrPermissionDenied), errors.Is(err, unix.ENOTDIR):
		return invalid("%s %q passes through a symlink or something not a directory", name, p)
	}
	return fmt.Errorf("%s %q: %w", name, p, err)
}

// makeTarget makes sure a publish target exists (missing directories on
// the way made 0750, as kubelet does): a directory for mount access, an
// empty file for block access (the device node is bound onto it). It
// reports whether it created it: only then may unpublish remove it. An
// existing target must be of the right kind and not a symlink.
//
// One Root serves the whole request: the parents are made below it (no
// symlink followed), and the target is made in the parent that lookup
// reaches again; a parent that is not a directory fails that mkdirat with
// ENOTDIR (InvalidArgument, as a symlink on the way is).
func (k kubeletDir) makeTarget(p string, block bool) (created bool, err error) {
	root, err := k.open("target_path", p)
	if err != nil {
		return false, err
	}
	defer root.Close()
	if _, err := root.MkdirAll(filepath.Dir(p), false); err != nil {
		return false, pathError("target_path", p, err)
	}
	if created, err = root.Create(p, block); err != nil || created {
		return created, pathError("target_path", p, err)
	}
	st, err := root.Lstat(p)
	if err != nil {
		return false, pathError("target_path", p, err)
	}
	switch mode := st.Mode & unix.S_IFMT; {
	case mode == unix.S_IFDIR && !block, mode == unix.S_IFREG && block:
		return false, nil
	case mode == unix.S_IFLNK:
		return false, invalid("target_path %q is a symlink", p)
	default:
		return false, invalid("target_path %q exists and is not a %s", p, map[bool]string{true: "file", false: "directory"}[block])
	}
}

// targetMissing reports whether the publish target p does not exist yet
// (nor its parent), without following symlinks: whether it is the
// plugin's to make.
func (k kubeletDir) targetMissing(p string) (bool, error) {
	root, err := k.open("target_path", p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer root.Close()
	_, err = root.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ENOTDIR) {
		return true, nil
	}
	if err != nil {
		return false, pathError("target_path", p, err)
	}
	return false, nil
}

// removeTarget removes a target the plugin created, and only if it is
// still what it made: an empty directory, an empty regular file, or the
// device node of a block publish in NRI mode. A target that is gone is
// fine; one that now holds something (written while nothing was mounted)
// is left for its owner, and so is a symlink.
func (k kubeletDir) removeTarget(p string) error {
	root, err := k.open("target_path", p)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	defer root.Close()
	if err := root.RemoveIfEmpty(p); err != nil {
		return pathError("target_path", p, err)
	}
	return nil
}

// isMountPoint reports whether p is a mount point (mountns.IsMountPoint:
// a symlink at p is not followed). A path whose check fails (a dead FUSE
// mount on the way answers ENOTCONN) counts as mounted: unmounting it is
// safer than believing it gone.
func (d *Driver) isMountPoint(p string) bool {
	mounted, err := mountns.IsMountPoint(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	return mounted || err != nil
}
