package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
)

// kubeletDir confines the staging and target paths a CO sends to kubelet's
// directory, the way kubelet makes them: a path must lie under it, and no
// directory between the root and the path's last element may be a
// symlink, which whoever can write inside (a pod with a hostPath) could
// point at /etc. The plugin does not see kubelet's directory (every pod's
// Secrets and tokens are in it): the string checks are made here, and
// everything that looks into the tree, or makes or removes a target
// there, is a mounter.Targets call, which resolves the path below its own
// kubelet dir without following a symlink, also one planted after a check.
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

// checkVolumePath checks a node request's volume ID (its presence first)
// and the path it names in field name (see checkPath).
func (d *Driver) checkVolumePath(ctx context.Context, id, name, p string) error {
	if err := requireVolumeID(id); err != nil {
		return err
	}
	return d.checkPath(ctx, name, p)
}

// checkStaged checks what every request about a staged volume carries:
// its ID, the staging path (under kubelet's directory) and the capability
// it was staged with.
func (d *Driver) checkStaged(ctx context.Context, id, stagingPath string, vc *csi.VolumeCapability) (capability, error) {
	if err := d.checkVolumePath(ctx, id, "staging_target_path", stagingPath); err != nil {
		return capability{}, err
	}
	return checkCapability(vc)
}

// checkPath refuses p unless it lies under the root and every directory
// of it that exists, down to its parent, is reached without a symlink
// (the mounter looks). Missing directories are fine: kubelet makes a
// staging path's parents lazily.
func (d *Driver) checkPath(ctx context.Context, name, p string) error {
	_, err := d.pathState(ctx, name, p)
	return err
}

// pathState is checkPath that also returns what the mounter saw at p.
func (d *Driver) pathState(ctx context.Context, name, p string) (mounter.Target, error) {
	if _, err := d.kubelet.rel(name, p); err != nil {
		return mounter.Target{}, err
	}
	st, err := d.node.TargetState(ctx, p)
	if err != nil {
		return st, fmt.Errorf("%s: %w", name, err)
	}
	return st, nil
}

// targetState is what the mounter sees at a publish's target: the state
// its request was checked with when there is one (capability.target),
// else asked now.
func (d *Driver) targetState(ctx context.Context, c capability, target string) (mounter.Target, error) {
	if c.target != nil {
		return *c.target, nil
	}
	return d.pathState(ctx, "target_path", target)
}

// isMountPoint reports whether p, a path below kubelet's directory, is a
// mount point, as the mounter sees it (mounter.Target.Mounted: a path
// whose check fails counts as mounted). A mounter that cannot answer
// counts as mounted too: unmounting is safer than believing it gone.
func (d *Driver) isMountPoint(ctx context.Context, p string) bool {
	st, err := d.node.TargetState(ctx, p)
	return st.Mounted || err != nil
}
