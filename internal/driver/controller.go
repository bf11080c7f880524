package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/topology"
)

// Capacity is provisioned in whole MiB; a request of 0 gets DefaultCapacity.
const (
	CapacityUnit    int64 = 1 << 20
	DefaultCapacity int64 = 1 << 30
)

// minCapacity is the smallest image each filesystem can be made on.
var minCapacity = map[string]int64{"ext4": 16 << 20, "xfs": 300 << 20}

// Parameter keys of a StorageClass.
const (
	paramType      = "type"
	paramFsType    = "fsType"
	paramCSIFsType = source.ReservedPrefix + "fstype"
)

func (d *Driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// createParams are the validated parameters of a CreateVolume.
type createParams struct {
	typ    string
	prov   source.Provisioner
	fsType string
	size   int64
}

func (d *Driver) parseCreate(req *csi.CreateVolumeRequest) (createParams, error) {
	if err := requireField("name", req.GetName()); err != nil {
		return createParams{}, err
	}
	if err := model.ValidID(req.GetName()); err != nil {
		return createParams{}, invalid("name %q cannot name a node-local volume (1-128 of [A-Za-z0-9._-])", req.GetName())
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return createParams{}, err
	}
	p := createParams{typ: cmp.Or(req.GetParameters()[paramType], d.opts.DefaultType)}
	for k := range req.GetParameters() {
		switch {
		case k == paramType:
		case k == paramFsType || k == paramCSIFsType:
			p.fsType = req.GetParameters()[k]
		case k == ctxNRI:
			if _, err := parseNRI(req.GetParameters()); err != nil {
				return p, err
			}
		case strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return p, invalid("unknown parameter %q (known: %s, %s, %s, %s)", k, paramType, paramFsType, paramCSIFsType, ctxNRI)
		}
	}
	var ok bool
	if p.prov, ok = d.provisioner(p.typ); !ok {
		return p, invalid("parameter type=%q: only %s can be provisioned", p.typ, d.provisionerTypes())
	}
	if p.fsType == "" {
		for _, c := range req.GetVolumeCapabilities() {
			if fs := c.GetMount().GetFsType(); fs != "" {
				p.fsType = fs
			}
		}
	}
	if p.fsType == "" {
		p.fsType = d.opts.Config.DefaultFsType
	}
	if err := checkFormattable(p.fsType); err != nil {
		return p, err
	}
	var err error
	p.size, err = capacityFor(req.GetCapacityRange(), p.fsType)
	return p, err
}

// checkFormattable accepts the filesystems this plugin can make.
func checkFormattable(fsType string) error {
	if _, ok := minCapacity[fsType]; !ok {
		return invalid("fsType %q cannot be made (supported: %s)", fsType, strings.Join(slices.Sorted(maps.Keys(minCapacity)), ", "))
	}
	return nil
}

// roundCapacity raises size to the filesystem's minimum and whole MiB.
func roundCapacity(size int64, fsType string) int64 {
	size = max(size, minCapacity[fsType])
	return (size + CapacityUnit - 1) / CapacityUnit * CapacityUnit
}

// capacityFor rounds the requested size up to whole MiB and to the
// filesystem's minimum, within the limit.
func capacityFor(r *csi.CapacityRange, fsType string) (int64, error) {
	required, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	if required < 0 || limit < 0 {
		return 0, fmt.Errorf("capacity range must not be negative: %w", errdefs.ErrOutOfRange)
	}
	if limit > 0 && required > limit {
		return 0, fmt.Errorf("required_bytes %d exceeds limit_bytes %d: %w", required, limit, errdefs.ErrOutOfRange)
	}
	size := required
	if size == 0 {
		size = DefaultCapacity
		if limit > 0 && limit < size {
			size = limit
		}
	}
	size = roundCapacity(size, fsType)
	if limit > 0 && size > limit {
		return 0, fmt.Errorf("the smallest %s volume in whole MiB (%d bytes) exceeds limit_bytes %d: %w", fsType, size, limit, errdefs.ErrOutOfRange)
	}
	return size, nil
}

func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	p, err := d.parseCreate(req)
	if err != nil {
		return nil, err
	}
	if err := d.checkTopology(req.GetAccessibilityRequirements()); err != nil {
		return nil, err
	}
	id := req.GetName()
	unlock, err := d.records.TryLock(id, "CreateVolume")
	if err != nil {
		return nil, err
	}
	defer unlock()

	v, err := d.records.Get(id)
	switch {
	case err == nil && !v.Creating:
		if err := compatible(v, req, p); err != nil {
			return nil, err
		}
		return d.createResponse(v), nil
	case err == nil && v.ContentSource != nil:
		if err := d.abandonCopy(ctx, v); err != nil {
			return nil, err
		}
	case err == nil:
		// A create interrupted after its intent, never answered: start
		// over with this request, whatever the interrupted one asked.
		if err := d.removeImage(v); err != nil {
			return nil, err
		}
	case !errors.Is(err, errdefs.ErrNotFound):
		return nil, err
	}
	if req.GetVolumeContentSource() != nil {
		v, err := d.createFromContent(ctx, id, req, p)
		if err != nil {
			return nil, err
		}
		return d.createResponse(v), nil
	}
	if err := d.checkFits(id, p.size); err != nil {
		return nil, err
	}
	v = &model.Volume{ID: id, Kind: model.KindProvisioned, Type: p.typ,
		Image: p.prov.ImagePath(model.KindProvisioned, id), CapacityBytes: p.size,
		FsType: p.fsType, Parameters: maps.Clone(req.GetParameters()), Creating: true}
	if err := d.records.Put(v, journal.Durable); err != nil {
		return nil, err
	}
	if err := makeImage(ctx, p.prov, v, req.GetVolumeCapabilities()); err != nil {
		// No record outlives a failed create: the name stays free.
		err = fmt.Errorf("create image for %s: %w", id, imageError(err))
		return nil, errors.Join(err, p.prov.RemoveImage(v.Image), d.records.Delete(id, journal.Durable))
	}
	v.Creating = false
	if err := d.records.Put(v, journal.Durable); err != nil {
		return nil, err
	}
	return d.createResponse(v), nil
}

// checkFits refuses a capacity the state dir's filesystem cannot hold:
// more than its whole size (images are sparse, so free space is not the
// bound, but a filesystem never holds more than itself).
func (d *Driver) checkFits(id string, size int64) error {
	var st unix.Statfs_t
	if err := unix.Statfs(d.opts.StateDir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", d.opts.StateDir, err)
	}
	total := st.Blocks * uint64(st.Bsize)
	if st.Bsize > 0 && st.Blocks > math.MaxInt64/uint64(st.Bsize) {
		total = math.MaxInt64
	}
	if uint64(size) > total {
		return fmt.Errorf("volume %s: %d bytes is more than the state dir's filesystem holds (%d bytes): %w", id, size, total, errdefs.ErrOutOfRange)
	}
	return nil
}

// imageError marks a size the filesystem refuses for one file (EFBIG) as
// out of range.
func imageError(err error) error {
	if errors.Is(err, unix.EFBIG) {
		return fmt.Errorf("%w: %w", err, errdefs.ErrOutOfRange)
	}
	return err
}

// compatible decides whether a repeated CreateVolume names the same volume.
func compatible(v *model.Volume, req *csi.CreateVolumeRequest, p createParams) error {
	r := req.GetCapacityRange()
	if !sameContent(v.ContentSource, req.GetVolumeContentSource()) {
		return fmt.Errorf("volume %s exists with other content (%v): %w", v.ID, contentSource(v.ContentSource), errdefs.ErrAlreadyExists)
	}
	if r.GetRequiredBytes() > v.CapacityBytes || (r.GetLimitBytes() > 0 && r.GetLimitBytes() < v.CapacityBytes) {
		return fmt.Errorf("volume %s exists with %d bytes, outside the requested range: %w", v.ID, v.CapacityBytes, errdefs.ErrAlreadyExists)
	}
	if v.FsType != p.fsType && v.ContentSource == nil {
		return fmt.Errorf("volume %s exists with fsType %s, not %s: %w", v.ID, v.FsType, p.fsType, errdefs.ErrAlreadyExists)
	}
	return nil
}

func (d *Driver) createResponse(v *model.Volume) *csi.CreateVolumeResponse {
	vctx := map[string]string{paramType: v.Type, paramFsType: v.FsType}
	if nri, ok := v.Parameters[ctxNRI]; ok {
		vctx[ctxNRI] = nri // the StorageClass's choice reaches every publish
	}
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:           v.ID,
		CapacityBytes:      v.CapacityBytes,
		VolumeContext:      vctx,
		AccessibleTopology: []*csi.Topology{d.topology()},
		ContentSource:      contentSource(v.ContentSource),
	}}
}

func (d *Driver) topology() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{topology.Key: d.opts.NodeID}}
}

// checkTopology refuses a request that may not land on this node.
func (d *Driver) checkTopology(req *csi.TopologyRequirement) error {
	requisite := req.GetRequisite()
	if len(requisite) == 0 {
		return nil
	}
	if slices.ContainsFunc(requisite, func(t *csi.Topology) bool {
		n, ok := t.GetSegments()[topology.Key]
		return !ok || n == d.opts.NodeID
	}) {
		return nil
	}
	return fmt.Errorf("requisite topology excludes node %s: %w", d.opts.NodeID, errdefs.ErrResourceExhausted)
}

func (d *Driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireField("volume_id", id); err != nil {
		return nil, err
	}
	if model.ValidID(id) != nil {
		return &csi.DeleteVolumeResponse{}, nil // such a volume cannot exist here
	}
	v, unlock, err := d.records.Locked(id, "DeleteVolume")
	defer unlock()
	if errors.Is(err, errdefs.ErrNotFound) {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if v.Stage != nil {
		return nil, fmt.Errorf("volume %s is staged at %s: %w", id, v.Stage.StagingPath, errdefs.ErrFailedPrecondition)
	}
	if v.Kind != model.KindProvisioned {
		return nil, fmt.Errorf("volume %s is %s, not provisioned: %w", id, v.Kind, errdefs.ErrFailedPrecondition)
	}
	if v.Creating && v.ContentSource != nil {
		// A copy that failed or was cut short: its record may say the
		// source was left frozen, and only undoing it thaws the source.
		return &csi.DeleteVolumeResponse{}, d.abandonCopy(ctx, v)
	}
	prov, err := d.provisionerOf(v)
	if err != nil {
		return nil, err
	}
	// Deleting an image a device still reads would leave that device
	// serving a file nobody can see or clean up: refuse until it is gone.
	if err := prov.RemoveDetachedImage(ctx, v.Image); err != nil {
		return nil, fmt.Errorf("volume %s: %w", id, err)
	}
	return &csi.DeleteVolumeResponse{}, d.records.Delete(id, journal.Durable)
}

func (d *Driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if err := requireVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalid("volume_capabilities are required")
	}
	if _, err := d.records.Get(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// GetCapacity reports the free bytes of the state dir's filesystem. Images
// are sparse, so this is what new volumes can still be written into.
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(d.opts.StateDir, &st); err != nil {
		return nil, fmt.Errorf("statfs %s: %w", d.opts.StateDir, err)
	}
	return &csi.GetCapacityResponse{AvailableCapacity: int64(st.Bavail) * st.Bsize}, nil
}

func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if req.GetCapacityRange() == nil {
		return nil, invalid("capacity_range is required")
	}
	v, unlock, err := d.records.Locked(id, "ControllerExpandVolume")
	defer unlock()
	if err != nil {
		return nil, err
	}
	if v.Kind != model.KindProvisioned {
		// The image of a static volume is the admin's, and other kinds
		// have no image here: only what CreateVolume made can grow.
		return nil, fmt.Errorf("volume %s is %s, not provisioned by this plugin: %w", id, v.Kind, errdefs.ErrFailedPrecondition)
	}
	prov, err := d.provisionerOf(v)
	if err != nil {
		return nil, err
	}
	size, err := capacityFor(req.GetCapacityRange(), v.FsType)
	if err != nil {
		return nil, err
	}
	if size > v.CapacityBytes {
		if err := d.checkFits(id, size); err != nil {
			return nil, err
		}
		if err := prov.GrowImage(v.Image, size); err != nil {
			return nil, fmt.Errorf("grow image of %s: %w", id, imageError(err))
		}
		v.CapacityBytes = size
		if err := d.records.Put(v, journal.Durable); err != nil {
			return nil, err
		}
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: true}, nil
}
