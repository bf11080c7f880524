// Package loop is the loop-device volume source: an image file (made by
// CreateVolume under the state dir, an admin's image under an allowed root,
// or an inline ephemeral volume's) attached to a loop device.
//
// The mounter attaches the device (with LOOP_CONFIGURE and autoclear) and
// holds it open while the volume is staged: the kernel detaches it by
// itself when the mounter dies and no mount uses it, so a crash never
// leaks a loop device. The source keeps only the device's identity (its
// number and the image's inode), which it hands back to the mounter for
// everything it does with the device; Adopt attaches again what a
// restart cleared.
package loop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/internal/blockdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Type is the volume_context type of this source.
const Type = "loop"

// State is what the journal keeps of a staged loop volume.
type State struct {
	Device   string           `json:"device"`
	Identity loopdev.Identity `json:"identity"`
	DirectIO bool             `json:"directIO,omitempty"`
	ReadOnly bool             `json:"readOnly,omitempty"`
	// FsType is the filesystem found or made on the device ("" for block).
	FsType string `json:"fsType,omitempty"`
	// Chain is set for a writable overlay over a read-only image.
	Chain *Chain `json:"chain,omitempty"`
}

func (st State) device() mounter.Device {
	return mounter.Device{Path: st.Device, Major: st.Identity.Major, Minor: st.Identity.Minor}
}

// Devices is what the source asks of the mounter.
type Devices interface {
	mounter.Loops
	mounter.Filesystems
	mounter.Chains
}

// Source attaches images to loop devices through the mounter.
type Source struct {
	// StateDir holds chain mounts and scratch images.
	StateDir string
	// Devices is the mounter.
	Devices Devices
	// Metrics times attach, format and detach (nil: not recorded).
	Metrics *metrics.Metrics
	// ImageRoots are the admin's directories for static images.
	ImageRoots []string
	// MountableTypes are the filesystems a plan may mount; a device holding
	// anything else is refused rather than reformatted.
	MountableTypes []string

	blockSizes blockSizes // of images staged before
}

var (
	_ source.Snapshotter   = (*Source)(nil)
	_ source.Expander      = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
	_ source.Keeper        = (*Source)(nil)
	_ source.Forgetter     = (*Source)(nil)
)

// New returns a loop source keeping its scratch images under stateDir and
// asking devs for its devices.
func New(stateDir string, devs Devices) *Source {
	return &Source{StateDir: stateDir, Devices: devs, MountableTypes: blockdev.MountableTypes}
}

// Stage attaches v.Image and, for mount access, makes sure it holds a
// filesystem. The device is not mounted anywhere: the plan mounts it.
func (s *Source) Stage(ctx context.Context, v source.Volume, req source.StageRequest) (_ json.RawMessage, err error) {
	chained := wantsChain(v)
	if chained && req.Block {
		return nil, fmt.Errorf("overlay volumes have no block access: %w", errdefs.ErrInvalidArgument)
	}
	// The image under an overlay is never written, whatever the access mode.
	ro := req.ReadOnly || chained
	lr := mounter.LoopRequest{Image: v.Image, ReadOnly: ro, DirectIO: true}
	switch {
	case req.Block:
		// The consumer writes the device raw and may make another
		// filesystem: read the superblock again at the next mount stage.
		s.blockSizes.forget(v.Image)
	case !chained:
		lr.BlockSize = s.blockSizes.get(v.Image)
	}
	var l mounter.Loop
	if err := s.Metrics.Step("attach", func() (err error) {
		l, err = s.Devices.AttachLoop(ctx, lr)
		return err
	}); err != nil {
		return nil, fmt.Errorf("attach %s: %w", v.Image, err)
	}
	defer func() {
		if err != nil {
			if derr := s.Devices.DetachLoop(context.WithoutCancel(ctx), l.Identity); derr != nil {
				klog.FromContext(ctx).Error(derr, "Rollback: detach failed", "device", l.Path)
			}
		}
	}()
	st := State{Device: l.Path, Identity: l.Identity, DirectIO: l.DirectIO, ReadOnly: l.ReadOnly}
	if chained {
		if st.FsType, st.Chain, err = s.stageChain(ctx, v, l.Device, req.SELinuxContext); err != nil {
			return nil, err
		}
	} else if !req.Block {
		if st.FsType, err = s.ensureFilesystem(ctx, v, l.Device, req); err != nil {
			return nil, err
		}
	}
	return json.Marshal(st)
}

// stageChain checks that the image holds a read-only filesystem and builds
// the overlay's layers over it.
func (s *Source) stageChain(ctx context.Context, v source.Volume, dev mounter.Device, label string) (string, *Chain, error) {
	fsType, err := s.Devices.Detect(ctx, dev)
	if err != nil {
		return "", nil, err
	}
	if !slices.Contains(readOnlyTypes, fsType) {
		return "", nil, fmt.Errorf("overlay needs a read-only image (%v); %s holds %q: %w", readOnlyTypes, v.Image, fsType, errdefs.ErrFailedPrecondition)
	}
	c, err := s.buildChain(ctx, v, dev, fsType, label)
	return fsType, c, err
}

// ensureFilesystem returns the filesystem on dev, making one only when
// the device is blank or when a format of ours was interrupted.
func (s *Source) ensureFilesystem(ctx context.Context, v source.Volume, dev mounter.Device, req source.StageRequest) (string, error) {
	return blockdev.EnsureFilesystem(ctx, v, dev, req, blockdev.Filesystem{What: "image " + v.Image, Tools: s.Devices, Mountable: s.MountableTypes, Metrics: s.Metrics})
}

// Plan mounts the device (mount access), binds its node (block access), or
// binds the chain's overlay.
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if st.Chain != nil {
		return chainPlan(st.Chain, req.ReadOnly, req.MountFlags)
	}
	return blockdev.Plan(v.ID, st.Device, st.FsType, st.ReadOnly, req)
}

// Unstage detaches the device if it is still backed by v's image.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	if v.Staging && len(v.State) == 0 {
		return s.undoUnrecorded(ctx, v)
	}
	st, err := source.DecodeState[State](v)
	if err != nil {
		return err
	}
	if st.Chain != nil {
		if err := s.teardownChain(ctx, v.ID, st.Chain); err != nil {
			return err
		}
	}
	return s.Metrics.Step("detach", func() error { return s.Devices.DetachLoop(ctx, st.Identity) })
}

// undoUnrecorded undoes a stage that died before it recorded its state.
// Its chain, if it got that far, sits at a path fixed by the volume ID; a
// device it attached is let go by the startup reconcile (KeepLoops), which
// knows no volume that names it.
func (s *Source) undoUnrecorded(ctx context.Context, v source.Volume) error {
	if err := s.Devices.TeardownChain(ctx, v.ID); err != nil {
		return err
	}
	return removeImage(s.scratchImage(v.ID))
}

// Forget removes what a stage of an ended boot left on disk: its
// overlay's directories and scratch image, found by the volume's ID as
// undoUnrecorded finds them. The recorded devices are never detached:
// their numbers may name another image's device in this boot.
func (s *Source) Forget(ctx context.Context, v source.Volume) error {
	return s.undoUnrecorded(ctx, v)
}

// Adopt checks that a staged volume's device is still the one the mounter
// holds for it, and attaches the image again when it is gone (the node
// rebooted, or a mounter died with nothing mounting the device).
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	l, err := s.Devices.AdoptLoop(ctx, st.Identity)
	if errors.Is(err, errdefs.ErrNotFound) {
		klog.FromContext(ctx).Info("Loop device gone; attaching the image again", "volume", v.ID, "image", v.Image)
		lr := mounter.LoopRequest{Image: v.Image, ReadOnly: st.ReadOnly, DirectIO: true}
		if st.FsType != "" && st.Chain == nil {
			lr.BlockSize = s.blockSizes.get(v.Image)
		}
		l, err = s.Devices.AttachLoop(ctx, lr)
	}
	if err != nil {
		return nil, err
	}
	moved := l.Identity != st.Identity
	st.Device, st.Identity, st.DirectIO = l.Path, l.Identity, l.DirectIO
	if st.Chain != nil && (moved || !chainIntact(st.Chain)) {
		// The layers are gone (a reboot) or sit on a device that is gone:
		// build them anew. A tmpfs upper's writes did not survive; a
		// scratch image's are discarded too, since an overlay's upper is
		// only valid with its own work dir.
		klog.FromContext(ctx).Info("Overlay layers gone; building them again", "volume", v.ID)
		label := st.Chain.SELinuxContext
		if err := s.teardownChain(ctx, v.ID, st.Chain); err != nil {
			return nil, err
		}
		if st.Chain, err = s.buildChain(ctx, v, l.Device, st.FsType, label); err != nil {
			return nil, err
		}
	}
	return json.Marshal(st)
}

// Expand makes the loop device see its grown image and grows the
// filesystem, online (a volume in use) or through a private mount of the
// mounter's.
func (s *Source) Expand(ctx context.Context, v source.Volume) (int64, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return 0, err
	}
	size, err := s.Devices.ResizeLoop(ctx, st.Identity)
	if err != nil {
		return 0, err
	}
	if st.FsType != "" && st.Chain == nil {
		if st.ReadOnly {
			return 0, fmt.Errorf("volume %s is read-only and cannot grow its filesystem: %w", v.ID, errdefs.ErrFailedPrecondition)
		}
		if err := s.Devices.GrowFS(ctx, st.device(), st.FsType, false); err != nil {
			return 0, err
		}
	}
	return size, nil
}

// GrowUnmounted grows the filesystem of a volume being staged, whose
// device nothing has mounted yet (a copy made bigger than its source):
// ext4 offline, xfs through a private mount (it grows only mounted).
func (s *Source) GrowUnmounted(ctx context.Context, v source.Volume) error {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return err
	}
	if st.FsType == "" || st.ReadOnly || st.Chain != nil {
		return nil
	}
	if _, err := s.Devices.ResizeLoop(ctx, st.Identity); err != nil {
		return err
	}
	return s.Devices.GrowFS(ctx, st.device(), st.FsType, true)
}

// Health reports a staged volume whose loop device is no longer the one
// the mounter attached for it (detached behind the plugin's back), or
// whose image is no longer the file the device reads (imageHealth).
func (s *Source) Health(ctx context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	if _, err := s.Devices.AdoptLoop(ctx, st.Identity); err != nil {
		return source.Health{Abnormal: true, Reason: "DeviceGone",
			Message: fmt.Sprintf("%s is no longer backed by %s: %v", st.Device, v.Image, err)}
	}
	return imageHealth(v.Image, st)
}

// Keep tells the mounter which loop devices the staged volumes hold (their
// own, and their chains' scratch devices), so that it lets go of the others
// it attached before since (a stage a crash interrupted before it recorded
// its device; a volume whose record is gone).
func (s *Source) Keep(ctx context.Context, staged []source.Volume, since time.Time) error {
	var ids []loopdev.Identity
	for _, v := range staged {
		ids = append(ids, identities(v.State)...)
	}
	n, err := s.Devices.KeepLoops(ctx, ids, since)
	if n > 0 {
		klog.FromContext(ctx).Info("The mounter let go of loop devices no staged volume holds", "devices", n)
	}
	return err
}

// identities lists the loop devices of a staged volume's state.
func identities(state json.RawMessage) []loopdev.Identity {
	var st State
	if json.Unmarshal(state, &st) != nil || st.Identity.BackingIno == 0 {
		return nil
	}
	ids := []loopdev.Identity{st.Identity}
	if st.Chain != nil && st.Chain.Scratch != nil {
		ids = append(ids, st.Chain.Scratch.Identity)
	}
	return ids
}

// Describe names the image and, once staged, the loop device (the chain's
// top device for a writable overlay's volume is not shown).
func (s *Source) Describe(v source.Volume) source.Description {
	d := source.Description{Source: "image " + v.Image}
	if st, err := source.DecodeState[State](v); err == nil {
		d.Device = st.Device
		if st.Chain != nil {
			d.Source += " (chain)"
		}
	}
	return d
}
