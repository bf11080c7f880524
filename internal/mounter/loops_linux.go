package mounter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// AttachLoop attaches req.Image, a regular file below an image root
// reached without a symlink, with autoclear, and holds the device until
// DetachLoop. Past the bound of devices held at once (Options.MaxLoops)
// it is ResourceExhausted, before anything is attached.
func (n *Local) AttachLoop(ctx context.Context, req LoopRequest) (Loop, error) {
	if err := n.loopRoom(1); err != nil {
		return Loop{}, err
	}
	opts := loopdev.Options{ReadOnly: req.ReadOnly, DirectIO: req.DirectIO, Autoclear: true, BlockSize: req.BlockSize}
	dev, err := n.attach(ctx, req.Image, opts)
	if err != nil {
		return Loop{}, err
	}
	rec := loopRecord{Device: dev.Path, Identity: dev.Identity, Image: req.Image, ReadOnly: req.ReadOnly, DirectIO: req.DirectIO,
		BlockSize: req.BlockSize, Attached: time.Now()}
	if err := n.records.addLoop(rec, dev); err != nil {
		return Loop{}, errors.Join(err, dev.Detach())
	}
	// Attaches in flight at once all passed the check above: one that
	// finds the bound exceeded now lets go of its device.
	if err := n.loopRoom(0); err != nil {
		return Loop{}, errors.Join(err, dev.Detach(), n.records.dropLoop(dev.Identity))
	}
	return loopOf(dev), nil
}

// loopRoom is ResourceExhausted when holding more loop devices than now
// would exceed the bound.
func (n *Local) loopRoom(more int) error {
	limit := n.opts.MaxLoops
	if limit <= 0 {
		limit = DefaultMaxLoops
	}
	if held := n.records.loopCount(); held+more > limit {
		return fmt.Errorf("the mounter holds %d loop devices, its limit of %d (mountplan-sidecar serve --max-loop-devices raises it): %w",
			held, limit, errdefs.ErrResourceExhausted)
	}
	return nil
}

func (n *Local) attach(ctx context.Context, image string, opts loopdev.Options) (*loopdev.Device, error) {
	open, err := n.imageOpener(image)
	if err != nil {
		return nil, err
	}
	return loopdev.AttachWith(ctx, image, opts, open)
}

func loopOf(d *loopdev.Device) Loop {
	return Loop{Device: Device{Path: d.Path, Major: d.Identity.Major, Minor: d.Identity.Minor},
		Identity: d.Identity, DirectIO: d.DirectIO, ReadOnly: d.ReadOnly}
}

// imageOpener returns how to open image for a loop device: below the
// image root it lies in, without following a symlink below that root
// (the plugin writes <state-dir>/images and could plant one), and only a
// regular file: a device node there would hand a container a host disk.
func (n *Local) imageOpener(image string) (func(flags int) (*os.File, error), error) {
	if !plan.IsCleanAbs(image) {
		return nil, fmt.Errorf("image %q must be a clean absolute path: %w", image, errdefs.ErrInvalidArgument)
	}
	i := slices.IndexFunc(n.images, func(r imageRoot) bool { return plan.Within(r.dir(), image) && image != r.dir() })
	if i < 0 {
		return nil, fmt.Errorf("image %s lies under none of the mounter's image roots: %w", image, errdefs.ErrPermissionDenied)
	}
	base := n.images[i].base
	return func(flags int) (*os.File, error) {
		root, err := mountns.OpenRoot(base)
		if err != nil {
			return nil, err
		}
		defer root.Close()
		f, err := root.OpenFile(image, flags)
		if err != nil {
			return nil, err
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			f.Close()
			return nil, &os.PathError{Op: "fstat", Path: image, Err: err}
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			f.Close()
			return nil, fmt.Errorf("image %s is not a regular file: %w", image, errdefs.ErrPermissionDenied)
		}
		return f, nil
	}, nil
}

// AdoptLoop confirms a device the mounter attached is still bound as it
// was; a device it did not attach is ErrNotFound, as one that is gone.
func (n *Local) AdoptLoop(_ context.Context, id loopdev.Identity) (Loop, error) {
	h := n.records.loop(id)
	if h == nil {
		return Loop{}, fmt.Errorf("loop device %d:%d backed by %d:%d is not one the mounter holds: %w", id.Major, id.Minor, id.BackingDev, id.BackingIno, errdefs.ErrNotFound)
	}
	d, err := loopdev.Adopt(h.dev.Path, id)
	if err != nil {
		return Loop{}, err
	}
	_ = d.Close() // the held descriptor keeps it
	return loopOf(h.dev), nil
}

// DetachLoop detaches a device the mounter attached, if it is still
// bound to the same file.
func (n *Local) DetachLoop(ctx context.Context, id loopdev.Identity) error {
	h := n.records.loop(id)
	if h == nil {
		klog.FromContext(ctx).V(2).Info("Loop device not held; nothing to detach", "device", id)
		return nil
	}
	if err := h.dev.Detach(); err != nil {
		return err
	}
	return n.records.dropLoop(id)
}

// ResizeLoop has a held device see its grown image.
func (n *Local) ResizeLoop(_ context.Context, id loopdev.Identity) (int64, error) {
	h := n.records.loop(id)
	if h == nil {
		return 0, fmt.Errorf("loop device %d:%d is not one the mounter holds: %w", id.Major, id.Minor, errdefs.ErrFailedPrecondition)
	}
	if err := h.dev.SetCapacity(); err != nil {
		return 0, err
	}
	return h.dev.Size()
}

// KeepLoops lets go of every held device attached before attachedBefore
// and not in ids: the kernel clears it once nothing mounts it.
func (n *Local) KeepLoops(ctx context.Context, ids []loopdev.Identity, attachedBefore time.Time) (int, error) {
	keep := map[loopdev.Identity]bool{}
	for _, id := range ids {
		keep[id] = true
	}
	released := 0
	var errs []error
	for _, h := range n.records.heldLoops() {
		if keep[h.rec.Identity] || !h.rec.Attached.Before(attachedBefore) {
			continue
		}
		klog.FromContext(ctx).Info("Letting go of a loop device no staged volume names", "device", h.dev.Path, "image", h.rec.Image)
		errs = append(errs, h.dev.Close(), n.records.dropLoop(h.rec.Identity))
		released++
	}
	return released, errors.Join(errs...)
}

// restoreLoop takes back a recorded device after a restart: reopened if
// still bound to the recorded file, else attached again to the same
// image (the same file: its inode is checked) at the same number if that
// is free.
func (n *Local) restoreLoop(ctx context.Context, rec loopRecord) (*loopdev.Device, error) {
	id := rec.Identity
	var num int
	if _, err := fmt.Sscanf(rec.Device, "/dev/loop%d", &num); err != nil || rec.Device != fmt.Sprintf("/dev/loop%d", num) {
		return nil, fmt.Errorf("recorded device %q is not /dev/loopN: %w", rec.Device, errdefs.ErrInvalidArgument)
	}
	d, err := loopdev.Adopt(rec.Device, id)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return d, err
	}
	opts := loopdev.Options{ReadOnly: rec.ReadOnly, DirectIO: rec.DirectIO, Autoclear: true, BlockSize: rec.BlockSize, Prefer: &num}
	if d, err = n.attach(ctx, rec.Image, opts); err != nil {
		return nil, err
	}
	if d.Identity != id {
		// Another number, or the image was replaced: the plugin's record
		// of the device would be wrong, so it attaches afresh instead.
		return nil, errors.Join(fmt.Errorf("attached again as %+v, not %+v: %w", d.Identity, id, errdefs.ErrNotFound), d.Detach())
	}
	klog.FromContext(ctx).Info("Attached a loop device again after a restart", "device", d.Path, "image", rec.Image)
	return d, nil
}
