package loop

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/loopdev"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
)

// Volume parameters of a chained (overlay) volume.
const (
	ParamOverlay   = "overlay"   // "true": a writable overlay over a read-only image
	ParamUpperSize = "upperSize" // bytes of a scratch ext4 image for the upper layer; tmpfs when unset
)

// readOnlyTypes are the filesystems an overlay may use as its lower layer.
var readOnlyTypes = []string{"erofs", "squashfs"}

// Chain is a writable overlay over a read-only image. Its steps run at
// stage time under the state dir; the plan that leaves the plugin is one
// concrete overlay mount over these paths.
type Chain struct {
	Dir   string `json:"dir"`
	Lower string `json:"lower"` // the image's filesystem, mounted read-only
	Upper string `json:"upper"` // tmpfs or a scratch filesystem holding data/ and work/
	// Scratch is the upper layer's own image, when upperSize asked for one.
	Scratch *Scratch `json:"scratch,omitempty"`
}

// Scratch is a throwaway image that holds an overlay's writes.
type Scratch struct {
	Image    string           `json:"image"`
	Device   string           `json:"device"`
	Identity loopdev.Identity `json:"identity"`
}

func (c *Chain) dataDir() string { return filepath.Join(c.Upper, "data") }
func (c *Chain) workDir() string { return filepath.Join(c.Upper, "work") }

// wantsChain reports whether v asks for an overlay over its image.
func wantsChain(v source.Volume) bool { return v.Parameters[ParamOverlay] == "true" }

// buildChain mounts the lower image and a fresh upper under the state dir.
// On error it undoes every step it took.
func (s *Source) buildChain(ctx context.Context, v source.Volume, lowerDev, lowerType string) (c *Chain, err error) {
	c = s.chainAt(v.ID)
	dir := c.Dir
	defer func() {
		if err != nil {
			if terr := s.teardownChain(ctx, v.ID, c); terr != nil {
				klog.FromContext(ctx).Error(terr, "Rollback of overlay chain failed", "dir", dir)
			}
		}
	}()
	for _, d := range []string{c.Lower, c.Upper} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return c, err
		}
	}
	if err := mountAt(lowerDev, c.Lower, lowerType, unix.MS_RDONLY, ""); err != nil {
		return c, err
	}
	if err := s.mountUpper(ctx, v, c); err != nil {
		return c, err
	}
	for _, d := range []string{c.dataDir(), c.workDir()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return c, err
		}
	}
	return c, nil
}

func (s *Source) mountUpper(ctx context.Context, v source.Volume, c *Chain) error {
	size := v.Parameters[ParamUpperSize]
	if size == "" {
		return mountAt("tmpfs", c.Upper, "tmpfs", 0, "mode=0700")
	}
	n, err := strconv.ParseInt(size, 10, 64)
	if err != nil || n < 16<<20 {
		return fmt.Errorf("upperSize %q must be a byte count of at least 16 MiB: %w", size, errdefs.ErrInvalidArgument)
	}
	img := s.scratchImage(v.ID)
	if err := CreateImage(img, n); err != nil {
		return err
	}
	dev, err := loopdev.Attach(ctx, img, loopdev.Options{DirectIO: true, Autoclear: true})
	if err != nil {
		return errors.Join(err, RemoveImage(img))
	}
	// Recorded only once attached: the rollback detaches by this identity.
	c.Scratch = &Scratch{Image: img, Device: dev.Path, Identity: dev.Identity}
	s.hold(scratchKey(v.ID), dev)
	if err := fsutil.Format(ctx, dev.Path, "ext4"); err != nil {
		return err
	}
	return mountAt(dev.Path, c.Upper, "ext4", 0, "")
}

// teardownChain undoes buildChain in reverse order. Idempotent.
func (s *Source) teardownChain(ctx context.Context, id string, c *Chain) error {
	if err := mountns.Unmount(c.Upper, false); err != nil {
		return err
	}
	if c.Scratch != nil {
		if err := s.detach(ctx, scratchKey(id), c.Scratch.Device, c.Scratch.Identity); err != nil {
			return err
		}
		if err := RemoveImage(c.Scratch.Image); err != nil {
			return err
		}
	}
	if err := mountns.Unmount(c.Lower, false); err != nil {
		return err
	}
	for _, d := range []string{c.Upper, c.Lower, c.Dir} {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove %s: %w", d, err)
		}
	}
	return nil
}

// chainPlan is one overlay mount; read-only consumers get the lower layer.
// The CO's mount flags apply to either.
func chainPlan(c *Chain, readOnly bool, flags []string) []plan.Mount {
	if readOnly {
		return []plan.Mount{{Type: plan.TypeBind, Source: c.Lower, Options: plan.Options([]string{"nosuid", "nodev"}, true, flags...)}}
	}
	base := []string{"nosuid", "nodev", "lowerdir=" + c.Lower, "upperdir=" + c.dataDir(), "workdir=" + c.workDir()}
	return []plan.Mount{{Type: "overlay", Source: "overlay", Options: plan.Options(base, false, flags...)}}
}

// chainIntact reports whether both layers are still mounted.
func chainIntact(c *Chain) bool {
	for _, p := range []string{c.Lower, c.Upper} {
		if ok, err := mountns.IsMountPoint(p); err != nil || !ok {
			return false
		}
	}
	return true
}

func scratchKey(id string) string { return id + "/scratch" }

// chainAt is where volume id's layers live; the path depends on nothing else.
func (s *Source) chainAt(id string) *Chain {
	dir := filepath.Join(s.StateDir, "chains", id)
	return &Chain{Dir: dir, Lower: filepath.Join(dir, "lower"), Upper: filepath.Join(dir, "upper")}
}

func (s *Source) scratchImage(id string) string {
	return filepath.Join(s.StateDir, "images", "scratch", id+".img")
}

func mountAt(source, target, fsType string, flags uintptr, data string) error {
	if err := unix.Mount(source, target, fsType, flags|unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		return fmt.Errorf("mount %s (%s) at %s: %w", source, fsType, target, err)
	}
	return nil
}
