package driver

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
)

// tokenPrefix starts every page token: "mp1:<ID>" names the first entry
// of the next page by its ID, not by a position, so volumes or snapshots
// made or deleted between pages never shift what a token points at.
const tokenPrefix = "mp1:"

// page returns the entries of sorted (ascending by id) from the one a
// starting token names, at most max of them (0: all), and the token of
// the next page ("" when none is left). A token this plugin did not make
// is Aborted, as CSI asks.
func page[T any](sorted []T, id func(T) string, token string, max int32) ([]T, string, error) {
	if max < 0 {
		return nil, "", invalid("max_entries must not be negative")
	}
	start := 0
	if token != "" {
		after, ok := strings.CutPrefix(token, tokenPrefix)
		if !ok || model.ValidID(after) != nil {
			return nil, "", fmt.Errorf("starting_token %q was not made by this plugin: %w", token, errdefs.ErrAborted)
		}
		start, _ = slices.BinarySearchFunc(sorted, after, func(e T, t string) int { return strings.Compare(id(e), t) })
	}
	rest := sorted[start:]
	if max == 0 || int(max) >= len(rest) {
		return rest, "", nil
	}
	return rest[:max], tokenPrefix + id(rest[max]), nil
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

func (d *Driver) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	v, err := d.records.Get(id)
	if err == nil && !listed(v) {
		err = fmt.Errorf("volume %s: %w", id, errdefs.ErrNotFound)
	}
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
