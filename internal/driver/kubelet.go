package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
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
	parent, err := k.openParent(name, p, false)
	if parent != nil {
		parent.Close()
	}
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	return err
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

// openParent opens the directory p lies in, resolved below the root by
// mountns.Root (openat2, no symlink followed). With create, missing
// directories are made (0750, as kubelet does); without, a missing one is
// errdefs.ErrNotFound. A symlink or a non-directory on the way is
// InvalidArgument: the CO sent a path kubelet would not have made.
func (k kubeletDir) openParent(name, p string, create bool) (*os.File, error) {
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
	defer root.Close()
	dir := filepath.Dir(p)
	if create {
		_, err = root.MkdirAll(dir, false)
	}
	var parent *os.File
	if err == nil {
		parent, err = root.Open(dir)
	}
	if err == nil {
		var st unix.Stat_t
		if err = unix.Fstat(int(parent.Fd()), &st); err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			err = unix.ENOTDIR
		}
		if err != nil {
			parent.Close()
		}
	}
	switch {
	case errors.Is(err, errdefs.ErrPermissionDenied), errors.Is(err, unix.ENOTDIR):
		return nil, invalid("%s %q passes through a symlink or something not a directory", name, p)
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("%s %q: %w", name, p, err)
	case err != nil:
		return nil, fmt.Errorf("%s %q: open its parent: %w", name, p, err)
	}
	return parent, nil
}

// makeTarget makes sure a publish target exists: a directory for mount
// access, an empty file for block access (the device node is bound onto
// it). It reports whether it created it: only then may unpublish remove
// it. An existing target must be of the right kind and not a symlink.
func (k kubeletDir) makeTarget(p string, block bool) (created bool, err error) {
	parent, err := k.openParent("target_path", p, true)
	if err != nil {
		return false, err
	}
	defer parent.Close()
	name := filepath.Base(p)
	if block {
		fd, err := unix.Openat(int(parent.Fd()), name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o640)
		if err == nil {
			return true, unix.Close(fd)
		}
		if !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("create %s: %w", p, err)
		}
	} else {
		err := unix.Mkdirat(int(parent.Fd()), name, 0o750)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("mkdir %s: %w", p, err)
		}
	}
	var st unix.Stat_t
	if err := unix.Fstatat(int(parent.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false, fmt.Errorf("stat %s: %w", p, err)
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
	parent, err := k.openParent("target_path", p, false)
	if errors.Is(err, errdefs.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer parent.Close()
	var st unix.Stat_t
	err = unix.Fstatat(int(parent.Fd()), filepath.Base(p), &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat %s: %w", p, err)
	}
	return false, nil
}

// removeTarget removes a target the plugin created, and only if it is
// still what it made: an empty directory or an empty regular file. A
// target that is gone is fine; one that now holds something (written
// while nothing was mounted) is left for its owner, and so is a symlink.
func (k kubeletDir) removeTarget(p string) error {
	parent, err := k.openParent("target_path", p, false)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	defer parent.Close()
	name := filepath.Base(p)
	var st unix.Stat_t
	if err := unix.Fstatat(int(parent.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat %s: %w", p, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		err = unix.Unlinkat(int(parent.Fd()), name, unix.AT_REMOVEDIR)
		if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
			return nil // something was written there: not ours to remove
		}
	case unix.S_IFREG:
		if st.Size != 0 {
			return nil
		}
		err = unix.Unlinkat(int(parent.Fd()), name, 0)
	case unix.S_IFBLK: // the device node of a block publish in NRI mode
		err = unix.Unlinkat(int(parent.Fd()), name, 0)
	default:
		return nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", p, err)
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
