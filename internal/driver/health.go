package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/source"
)

// NodeGetVolumeHealth reports what the volume's source knows: a staged
// volume whose device or daemon is gone is INACCESSIBLE with a reason.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if err := requireVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	v, err := d.records.Get(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	resp := &csi.NodeGetVolumeHealthResponse{VolumeHealth: &csi.VolumeHealth{VolumeId: v.ID}}
	if !v.Staged() {
		return resp, nil
	}
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	hc, ok := src.(source.HealthChecker)
	if !ok {
		return resp, nil
	}
	if h := hc.Health(ctx, viewOf(v)); h.Abnormal {
		resp.VolumeHealth.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: h.Reason, Message: h.Message}}
	}
	return resp, nil
}
