package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/topology"
)

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
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
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
	p, err := d.parseClass(req.GetParameters(), req.GetVolumeCapabilities())
	if err != nil {
		return p, err
	}
	p.size, err = capacityFor(req.GetCapacityRange(), p.fsType)
	return p, err
}

// parseClass reads what a StorageClass's parameters (and the capabilities'
// fsType) decide about a new volume: the source that makes its image and
// the filesystem on it. CreateVolume and GetCapacity read them alike.
func (d *Driver) parseClass(params map[string]string, caps []*csi.VolumeCapability) (createParams, error) {
	p := createParams{typ: cmp.Or(params[paramType], d.opts.DefaultType)}
	for k := range params {
		switch {
		case k == paramType:
		case k == paramFsType || k == paramCSIFsType:
			p.fsType = params[k]
		case k == ctxNRI:
			if _, err := parseNRI(params); err != nil {
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
		for _, c := range caps {
			if fs := c.GetMount().GetFsType(); fs != "" {
				p.fsType = fs
			}
		}
	}
	if p.fsType == "" {
		p.fsType = d.opts.Config.DefaultFsType
	}
	return p, checkFormattable(p.fsType)
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

// listed are the volumes the controller answers for: those CreateVolume
// made and answered. Static and inline volumes are a node's business and
// unknown to the CO's controller.
func listed(v *model.Volume) bool { return v.Kind == model.KindProvisioned && !v.Creating }

func (d *Driver) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	all, err := d.records.List()
	if err != nil {
		return nil, err
	}
	vols := slices.DeleteFunc(all, func(v *model.Volume) bool { return !listed(v) })
	entries, next, err := page(vols, func(v *model.Volume) string { return v.ID }, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, v := range entries {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: d.csiVolume(v),
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: d.publishedNodes(v)},
		})
	}
	return resp, nil
}

// listedVolume is the record of a volume the controller lists (one that
// CreateVolume made): NotFound for any other, InvalidArgument for no ID.
func (d *Driver) listedVolume(id string) (*model.Volume, error) {
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	v, err := d.records.Get(id)
	if err == nil && !listed(v) {
		err = fmt.Errorf("volume %s: %w", id, errdefs.ErrNotFound)
	}
	return v, err
}

func (d *Driver) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	v, err := d.listedVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeResponse{
		Volume: d.csiVolume(v),
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: d.publishedNodes(v)},
	}, nil
}

// publishedNodes: a node-local volume is in use on this node, and only
// here, while it is staged.
func (d *Driver) publishedNodes(v *model.Volume) []string {
	if v.Stage == nil {
		return nil
	}
	return []string{d.opts.NodeID}
}

// csiVolume is what CreateVolume answered for v.
func (d *Driver) csiVolume(v *model.Volume) *csi.Volume {
	return d.createResponse(v).GetVolume()
}

// contentSource is v's content source as CSI names it.
func contentSource(cs *model.ContentSource) *csi.VolumeContentSource {
	switch {
	case cs == nil:
		return nil
	case cs.Snapshot != "":
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: cs.Snapshot}}}
	default:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: cs.Volume}}}
	}
}

// sameContent reports whether a repeated CreateVolume asks for the content
// the volume was made with.
func sameContent(have *model.ContentSource, want *csi.VolumeContentSource) bool {
	if have == nil || want == nil {
		return have == nil && want == nil
	}
	return have.Snapshot == want.GetSnapshot().GetSnapshotId() && have.Volume == want.GetVolume().GetVolumeId()
}
