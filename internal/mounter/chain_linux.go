package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// chainLowerTypes are the filesystems a chain's lower layer may hold.
var chainLowerTypes = []string{"erofs", "squashfs"}

// chainAt is where volume id's chain lives: <state-dir>/chains/<id>.
func (n *Local) chainAt(id string) (Chain, error) {
	dir, err := n.volumeDir("chains", id)
	if err != nil {
		return Chain{}, err
	}
	return Chain{Dir: dir, Lower: filepath.Join(dir, "lower"), Upper: filepath.Join(dir, "upper"), Merged: filepath.Join(dir, "merged")}, nil
}

// BuildChain mounts a volume's overlay chain below the state dir: the
// read-only image's filesystem at lower, the writable upper layer (tmpfs,
// or the scratch device's ext4) at upper, and at merged the overlay of
// both, which a plan then binds; a tmpfs upper is bounded by
// Options.ChainTmpfsSize. The overlay's layers are handed to the
// kernel as descriptors opened without following a symlink (the plugin
// writes in the upper layer and could plant one there). On error it
// undoes what it did.
func (n *Local) BuildChain(ctx context.Context, req ChainRequest) (c Chain, err error) {
	if err := checkLabel(req.SELinuxContext); err != nil {
		return c, err
	}
	if !slices.Contains(chainLowerTypes, req.LowerType) {
		return c, fmt.Errorf("a chain's lower layer holds %s, not %q: %w", chainLowerTypes, req.LowerType, errdefs.ErrInvalidArgument)
	}
	if c, err = n.chainAt(req.VolumeID); err != nil {
		return c, err
	}
	defer func() {
		if err != nil {
			if terr := n.TeardownChain(context.WithoutCancel(ctx), req.VolumeID); terr != nil {
				klog.FromContext(ctx).Error(terr, "Rollback of an overlay chain failed", "dir", c.Dir)
			}
		}
	}()
	for _, d := range []string{c.Lower, c.Upper, c.Merged} {
		if _, err := n.state.MkdirAll(d, false); err != nil {
			return c, err
		}
	}
	// The label goes on the two mounts a plan binds: the overlay and, for
	// a read-only consumer, the lower layer. The upper is only seen
	// through the overlay, which labels what it shows.
	label := withLabel(nil, req.SELinuxContext)
	if err := n.mountLayer(c.Lower, req.Lower, plan.Mount{Type: req.LowerType, Source: req.Lower.Path, Options: append([]string{"ro", "nosuid", "nodev"}, label...)}); err != nil {
		return c, err
	}
	upper := plan.Mount{Type: "tmpfs", Source: "mountplan-upper", Options: []string{"nosuid", "nodev", "mode=0700", fmt.Sprintf("size=%d", n.chainTmpfsSize())}}
	if req.Upper != nil {
		upper = plan.Mount{Type: "ext4", Source: req.Upper.Path, Options: []string{"nosuid", "nodev"}}
	}
	if err := n.mountLayer(c.Upper, ptrOr(req.Upper), upper); err != nil {
		return c, err
	}
	return c, n.mountOverlay(c, label)
}

// withLabel appends the context= option of an SELinux label to opts, when
// there is one. The mount checks it (mountns): one label, on a node that
// runs SELinux.
// checkLabel refuses a request's SELinux label that is not one label, as
// soon as the request arrives: before any side effect, and before any
// message quotes it. The mounts check it again where they are made.
func checkLabel(label string) error {
	if label == "" {
		return nil
	}
	_, _, err := plan.ParseContext(plan.ContextOption(label))
	return err
}

func withLabel(opts []string, label string) []string {
	if label == "" {
		return opts
	}
	return append(opts, plan.ContextOption(label))
}

// chainTmpfsSize is the bound of a tmpfs upper layer: without one, each
// chain could take half the node's memory (tmpfs's default), and the
// plugin asks for as many chains as it likes.
func (n *Local) chainTmpfsSize() int64 {
	if n.opts.ChainTmpfsSize > 0 {
		return n.opts.ChainTmpfsSize
	}
	return DefaultChainTmpfsSize
}

func ptrOr(d *Device) Device {
	if d == nil {
		return Device{}
	}
	return *d
}

// mountLayer mounts m (from dev, checked, unless m has no device) at
// dir, below the state dir, and records it.
func (n *Local) mountLayer(dir string, dev Device, m plan.Mount) error {
	var src *os.File
	if dev.Path != "" {
		f, err := n.openDev(dev)
		if err != nil {
			return err
		}
		defer f.Close()
		src = f
	}
	mnt, err := mountns.BuildFrom(m, src)
	if err != nil {
		return err
	}
	defer mnt.Close()
	return n.attachBelowState(dir, mnt, kindChain)
}

// attachBelowState attaches the detached mount mnt exactly at dir, opened
// below the state dir without following a symlink, and records it.
func (n *Local) attachBelowState(dir string, mnt *os.File, kind string) error {
	t, err := n.state.Open(dir)
	if err != nil {
		return err
	}
	defer t.Close()
	if err := mountns.AttachAt(mnt, t); err != nil {
		return err
	}
	top, err := n.state.Open(dir)
	if err != nil {
		return err
	}
	defer top.Close()
	return n.records.addMount(kind, dir, top)
}

// mountOverlay mounts the overlay of c's layers at c.Merged.
func (n *Local) mountOverlay(c Chain, label []string) error {
	var layers []*os.File
	defer func() { closeAll(layers) }()
	for _, d := range []string{filepath.Join(c.Upper, "data"), filepath.Join(c.Upper, "work")} {
		if _, err := n.state.MkdirAll(d, false); err != nil {
			return err
		}
	}
	opts := []string{"nosuid", "nodev"}
	for _, l := range []struct{ key, dir string }{{"lowerdir", c.Lower}, {"upperdir", filepath.Join(c.Upper, "data")}, {"workdir", filepath.Join(c.Upper, "work")}} {
		f, err := n.state.Open(l.dir)
		if err != nil {
			return err
		}
		layers = append(layers, f)
		opts = append(opts, fmt.Sprintf("%s=/proc/self/fd/%d", l.key, f.Fd()))
	}
	mnt, err := mountns.BuildFrom(plan.Mount{Type: "overlay", Source: "mountplan-chain", Options: append(opts, label...)}, nil)
	if err != nil {
		return err
	}
	defer mnt.Close()
	return n.attachBelowState(c.Merged, mnt, kindChain)
}

// TeardownChain unmounts a volume's chain, newest first, and removes its
// directories (never recursively). What is already gone is no error.
func (n *Local) TeardownChain(_ context.Context, volumeID string) error {
	c, err := n.chainAt(volumeID)
	if err != nil {
		return err
	}
	for _, d := range []string{c.Merged, c.Upper, c.Lower} {
		if err := n.unmountBelowState(d); err != nil {
			return err
		}
	}
	for _, d := range []string{c.Merged, c.Upper, c.Lower, c.Dir} {
		if err := n.state.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// unmountBelowState unmounts every mount stacked at dir (opened below the
// state dir without following a symlink, unmounted through its
// descriptor) and forgets its record.
func (n *Local) unmountBelowState(dir string) error {
	self, err := mountns.Self()
	if err != nil {
		return err
	}
	defer self.Close()
	for range 16 { // a stack of mounts at one place is short
		f, err := n.state.Open(dir)
		if errors.Is(err, fs.ErrNotExist) {
			break
		}
		if err != nil {
			return err
		}
		if _, err := mountOf(f); err != nil {
			f.Close()
			break // not a mount point (any more)
		}
		err = self.UnmountAt(f)
		f.Close()
		if err != nil {
			return err
		}
	}
	return n.records.dropMount(dir)
}
