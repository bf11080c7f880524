// Package loop is the loop-device volume source: an image file (made by
// CreateVolume under the state dir, an admin's image under an allowed root,
// or an inline ephemeral volume's) attached with LOOP_CONFIGURE.
//
// The device is attached with autoclear and its fd is held open by the
// plugin while the volume is staged. The kernel then detaches it by itself
// when the plugin dies and no mount uses it, so a crash never leaks a loop
// device; Adopt re-attaches after a restart.
package loop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/loopdev"
	"github.com/mountplan/mountplan/pkg/metrics"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/source/internal/blockdev"
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

// Source attaches images to loop devices.
type Source struct {
	// StateDir holds chain mounts and scratch images.
	StateDir string
	// Metrics times attach, format and detach (nil: not recorded).
	Metrics *metrics.Metrics
	// ImageRoots are the admin's directories for static images.
	ImageRoots []string
	// MountableTypes are the filesystems a plan may mount; a device holding
	// anything else is refused rather than reformatted.
	MountableTypes []string

	mu      sync.Mutex // guards devices only; volume operations are serialised by the driver's per-volume locks
	devices map[string]*loopdev.Device

	blockSizes blockSizes // of images staged before
}

var (
	_ source.Source        = (*Source)(nil)
	_ source.Expander      = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
)

// New returns a loop source keeping its mounts and scratch images under stateDir.
func New(stateDir string) *Source {
	return &Source{
		StateDir:       stateDir,
		MountableTypes: blockdev.MountableTypes,
		devices:        map[string]*loopdev.Device{},
	}
}

func (s *Source) hold(id string, d *loopdev.Device) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.devices[id]; old != nil && old != d {
		_ = old.Close()
	}
	s.devices[id] = d
}

func (s *Source) take(id string) *loopdev.Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.devices[id]
	delete(s.devices, id)
	return d
}

func (s *Source) held(id string) *loopdev.Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.devices[id]
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
	opts := loopdev.Options{ReadOnly: ro, DirectIO: true, Autoclear: true}
	switch {
	case req.Block:
		// The consumer writes the device raw and may make another
		// filesystem: read the superblock again at the next mount stage.
		s.blockSizes.forget(v.Image)
	case !chained:
		opts.BlockSize = s.blockSizes.get(v.Image)
	}
	var dev *loopdev.Device
	if err := s.Metrics.Step("attach", func() (err error) {
		dev, err = loopdev.Attach(ctx, v.Image, opts)
		return err
	}); err != nil {
		return nil, fmt.Errorf("attach %s: %w", v.Image, err)
	}
	defer func() {
		if err != nil {
			if derr := dev.Detach(); derr != nil {
				klog.FromContext(ctx).Error(derr, "Rollback: detach failed", "device", dev.Path)
			}
		}
	}()
	st := State{Device: dev.Path, Identity: dev.Identity, DirectIO: dev.DirectIO, ReadOnly: dev.ReadOnly}
	if chained {
		if st.FsType, st.Chain, err = s.stageChain(ctx, v, dev.Path); err != nil {
			return nil, err
		}
	} else if !req.Block {
		if st.FsType, err = s.ensureFilesystem(ctx, v, dev.Path, req); err != nil {
			return nil, err
		}
	}
	raw, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	s.hold(v.ID, dev)
	return raw, nil
}

// stageChain checks that the image holds a read-only filesystem and builds
// the overlay's layers over it.
func (s *Source) stageChain(ctx context.Context, v source.Volume, device string) (string, *Chain, error) {
	fsType, err := fsutil.Detect(ctx, device)
	if err != nil {
		return "", nil, err
	}
	if !slices.Contains(readOnlyTypes, fsType) {
		return "", nil, fmt.Errorf("overlay needs a read-only image (%v); %s holds %q: %w", readOnlyTypes, v.Image, fsType, errdefs.ErrFailedPrecondition)
	}
	c, err := s.buildChain(ctx, v, device, fsType)
	return fsType, c, err
}

// ensureFilesystem returns the filesystem on device, making one only when
// the device is blank or when a format of ours was interrupted.
func (s *Source) ensureFilesystem(ctx context.Context, v source.Volume, device string, req source.StageRequest) (string, error) {
	return blockdev.EnsureFilesystem(ctx, v, device, req, blockdev.Filesystem{What: "image " + v.Image, Mountable: s.MountableTypes, Metrics: s.Metrics})
}

// Plan mounts the device (mount access) or binds its node (block access).
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if st.Chain != nil {
		return chainPlan(st.Chain, req.ReadOnly, req.MountFlags), nil
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
	return s.detach(ctx, v.ID, st.Device, st.Identity)
}

// undoUnrecorded undoes a stage that died before it recorded its state.
// Its devices were attached with autoclear and went with the process that
// held them, unless a chain's layer mount still holds one; those layers
// sit at paths fixed by the volume ID, so they can be found without state.
func (s *Source) undoUnrecorded(ctx context.Context, v source.Volume) error {
	if err := s.teardownChain(ctx, v.ID, s.chainAt(v.ID)); err != nil {
		return err
	}
	if err := RemoveImage(s.scratchImage(v.ID)); err != nil {
		return err
	}
	if dev := s.take(v.ID); dev != nil {
		return dev.Detach()
	}
	return nil
}

// detach detaches the device held under key, or found by its identity.
func (s *Source) detach(ctx context.Context, key, device string, id loopdev.Identity) error {
	dev := s.take(key)
	if dev == nil {
		var err error
		dev, err = loopdev.Adopt(device, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			klog.FromContext(ctx).V(2).Info("Loop device already gone", "device", device)
			return nil
		}
		if err != nil {
			return err
		}
	}
	return s.Metrics.Step("detach", dev.Detach)
}

// Adopt reopens the device of a staged volume, or attaches the image again
// when the kernel cleared it after the plugin died (autoclear).
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if s.held(v.ID) != nil {
		return v.State, nil
	}
	dev, err := loopdev.Adopt(st.Device, st.Identity)
	if errors.Is(err, errdefs.ErrNotFound) {
		klog.FromContext(ctx).Info("Loop device gone; attaching the image again", "volume", v.ID, "image", v.Image)
		opts := loopdev.Options{ReadOnly: st.ReadOnly, DirectIO: true, Autoclear: true}
		if st.FsType != "" && st.Chain == nil {
			opts.BlockSize = s.blockSizes.get(v.Image)
		}
		dev, err = loopdev.Attach(ctx, v.Image, opts)
	}
	if err != nil {
		return nil, err
	}
	st.Device, st.Identity, st.DirectIO = dev.Path, dev.Identity, dev.DirectIO
	if st.Chain != nil && !chainIntact(st.Chain) {
		// The layers are gone (a reboot): build them anew. A tmpfs upper's
		// writes did not survive; a scratch image's are discarded too,
		// since an overlay's upper is only valid with its own work dir.
		klog.FromContext(ctx).Info("Overlay layers gone; building them again", "volume", v.ID)
		if err := s.teardownChain(ctx, v.ID, st.Chain); err != nil {
			_ = dev.Close()
			return nil, err
		}
		if st.Chain, err = s.buildChain(ctx, v, dev.Path, st.FsType); err != nil {
			_ = dev.Close()
			return nil, err
		}
	}
	raw, err := json.Marshal(st)
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	s.hold(v.ID, dev)
	return raw, nil
}

// Device returns the held device of a staged volume (for expansion).
func (s *Source) Device(v source.Volume) (*loopdev.Device, error) {
	if d := s.held(v.ID); d != nil {
		return d, nil
	}
	return nil, fmt.Errorf("volume %s has no attached loop device: %w", v.ID, errdefs.ErrFailedPrecondition)
}

// Expand makes the loop device see its grown image and grows the
// filesystem. Filesystems are grown online: at mountPath when the volume is
// mounted there, else through a private mount at scratch, because an
// offline resize2fs would need a full fsck first and xfs can only grow
// mounted.
func (s *Source) Expand(ctx context.Context, v source.Volume, mountPath, scratch string) (int64, error) {
	dev, err := s.Device(v)
	if err != nil {
		return 0, err
	}
	if err := dev.SetCapacity(); err != nil {
		return 0, err
	}
	st, err := source.DecodeState[State](v)
	if err != nil {
		return 0, err
	}
	if st.FsType != "" {
		if st.ReadOnly {
			return 0, fmt.Errorf("volume %s is read-only and cannot grow its filesystem: %w", v.ID, errdefs.ErrFailedPrecondition)
		}
		if err := growMounted(ctx, dev.Path, st.FsType, mountPath, scratch); err != nil {
			return 0, err
		}
	}
	return dev.Size()
}

// GrowUnmounted grows the filesystem of a volume being staged, whose
// device nothing has mounted yet (a copy made bigger than its source):
// ext4 offline (e2fsck, then resize2fs, which needs no CAP_SYS_RESOURCE),
// xfs through a private mount at scratch (it grows only mounted).
func (s *Source) GrowUnmounted(ctx context.Context, v source.Volume, scratch string) error {
	dev, err := s.Device(v)
	if err != nil {
		return err
	}
	st, err := source.DecodeState[State](v)
	if err != nil {
		return err
	}
	switch {
	case st.FsType == "" || st.ReadOnly:
		return nil
	case st.FsType == fsutil.Ext4:
		return fsutil.GrowOffline(ctx, dev.Path, st.FsType)
	}
	return growMounted(ctx, dev.Path, st.FsType, "", scratch)
}

func growMounted(ctx context.Context, device, fsType, mountPath, scratch string) error {
	if mountPath != "" {
		return fsutil.Resize(ctx, device, fsType, mountPath)
	}
	if err := os.MkdirAll(scratch, 0o700); err != nil {
		return err
	}
	defer os.Remove(scratch)
	if err := unix.Mount(device, scratch, fsType, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount %s at %s for resize: %w", device, scratch, err)
	}
	defer func() { _ = unix.Unmount(scratch, 0) }()
	return fsutil.Resize(ctx, device, fsType, scratch)
}

// Health reports a staged volume whose loop device is no longer backed by
// its image (detached behind the plugin's back).
func (s *Source) Health(ctx context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	dev, err := loopdev.Adopt(st.Device, st.Identity)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "DeviceGone",
			Message: fmt.Sprintf("%s is no longer backed by %s", st.Device, v.Image)}
	}
	_ = dev.Close()
	return source.Health{}
}
