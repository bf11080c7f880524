package loop

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Volume parameters of a chained (overlay) volume.
const (
	ParamOverlay   = "overlay"   // "true": a writable overlay over a read-only image
	ParamUpperSize = "upperSize" // bytes of a scratch ext4 image for the upper layer; tmpfs when unset
)

// readOnlyTypes are the filesystems an overlay may use as its lower layer.
var readOnlyTypes = []string{"erofs", "squashfs"}

// Chain is a writable overlay over a read-only image. The mounter mounts
// its layers at stage time under the state dir (mounter.Chains); the plan
// that leaves the plugin binds the overlay (or, for a read-only consumer,
// the image's filesystem).
type Chain struct {
	Dir    string `json:"dir"`
	Lower  string `json:"lower"`  // the image's filesystem, mounted read-only
	Upper  string `json:"upper"`  // tmpfs or a scratch filesystem holding data/ and work/
	Merged string `json:"merged"` // the overlay of both
	// SELinuxContext labels Lower and Merged, the two a plan binds (the
	// stage's context= flag); a rebuild labels them again.
	SELinuxContext string `json:"seLinuxContext,omitempty"`
	// Scratch is the upper layer's own image, when upperSize asked for one.
	Scratch *Scratch `json:"scratch,omitempty"`
}

// Scratch is a throwaway image that holds an overlay's writes.
type Scratch struct {
	Image    string           `json:"image"`
	Device   string           `json:"device"`
	Identity loopdev.Identity `json:"identity"`
}

// wantsChain reports whether v asks for an overlay over its image.
func wantsChain(v source.Volume) bool { return v.Parameters[ParamOverlay] == "true" }

// buildChain has the mounter mount the lower image, a fresh upper and the
// overlay under the state dir. On error it undoes every step it took.
func (s *Source) buildChain(ctx context.Context, v source.Volume, lower mounter.Device, lowerType, label string) (c *Chain, err error) {
	req := mounter.ChainRequest{VolumeID: v.ID, Lower: lower, LowerType: lowerType, SELinuxContext: label}
	c = &Chain{SELinuxContext: label}
	defer func() {
		if err != nil {
			if terr := s.teardownChain(context.WithoutCancel(ctx), v.ID, c); terr != nil {
				klog.FromContext(ctx).Error(terr, "Rollback of overlay chain failed", "volume", v.ID)
			}
		}
	}()
	if size := v.Parameters[ParamUpperSize]; size != "" {
		if c.Scratch, err = s.makeScratch(ctx, v.ID, size); err != nil {
			return c, err
		}
		req.Upper = &mounter.Device{Path: c.Scratch.Device, Major: c.Scratch.Identity.Major, Minor: c.Scratch.Identity.Minor}
	}
	made, err := s.Devices.BuildChain(ctx, req)
	if err != nil {
		return c, err
	}
	c.Dir, c.Lower, c.Upper, c.Merged = made.Dir, made.Lower, made.Upper, made.Merged
	return c, nil
}

// makeScratch creates the upper layer's image, attaches it and formats it.
func (s *Source) makeScratch(ctx context.Context, id, size string) (*Scratch, error) {
	n, err := strconv.ParseInt(size, 10, 64)
	if err != nil || n < 16<<20 {
		return nil, fmt.Errorf("upperSize %q must be a byte count of at least 16 MiB: %w", size, errdefs.ErrInvalidArgument)
	}
	img := s.scratchImage(id)
	if _, err := createImage(img, n, nil); err != nil {
		return nil, err
	}
	l, err := s.Devices.AttachLoop(ctx, mounter.LoopRequest{Image: img, DirectIO: true})
	if err != nil {
		return nil, errors.Join(err, removeImage(img))
	}
	// Recorded once attached: the rollback detaches by this identity.
	sc := &Scratch{Image: img, Device: l.Path, Identity: l.Identity}
	if err := s.Devices.Format(ctx, l.Device, "ext4"); err != nil {
		return sc, err
	}
	return sc, nil
}

// teardownChain undoes buildChain in reverse order. Idempotent.
func (s *Source) teardownChain(ctx context.Context, id string, c *Chain) error {
	if err := s.Devices.TeardownChain(ctx, id); err != nil {
		return err
	}
	if c == nil || c.Scratch == nil {
		return nil
	}
	if err := s.Devices.DetachLoop(ctx, c.Scratch.Identity); err != nil {
		return err
	}
	return removeImage(c.Scratch.Image)
}

// chainPlan binds the overlay; read-only consumers get the lower layer.
// The CO's mount flags apply to either, as a bind's flags.
func chainPlan(c *Chain, readOnly bool, flags []string) ([]plan.Mount, error) {
	// The label is on the layers the plan binds (buildChain): a bind
	// cannot take it.
	flags = plan.WithoutContext(flags)
	if err := plan.CheckBindOptions(flags); err != nil {
		return nil, err
	}
	src := c.Merged
	if readOnly {
		src = c.Lower
	}
	return []plan.Mount{{Type: plan.TypeBind, Source: src, Options: plan.Options([]string{"nosuid", "nodev"}, readOnly, flags...)}}, nil
}

// chainIntact reports whether the layers and the overlay are still mounted.
func chainIntact(c *Chain) bool {
	for _, p := range []string{c.Lower, c.Upper, c.Merged} {
		if ok, err := mountns.IsMountPoint(p); err != nil || !ok {
			return false
		}
	}
	return true
}

func (s *Source) scratchImage(id string) string {
	return filepath.Join(s.StateDir, "images", "scratch", id+".img")
}
