package driver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// ControllerGetVolumeHealth reports what this node-local controller knows
// of a volume CreateVolume made: whether its image is still the file the
// record names (controllerHealth). An empty list of statuses means no
// adverse condition is known, as CSI asks.
func (d *Driver) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	v, err := d.listedVolume(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: d.controllerHealth(ctx, v)}, nil
}

// ControllerListVolumeHealth lists the volumes ListVolumes lists that have
// an adverse condition (healthy ones are left out, as CSI recommends), in
// the order and with the page tokens of ListVolumes. Health is worked out
// only for the volumes a page walks over, and one more: the next token
// names the next abnormal volume, so a page is never empty while one is
// left.
func (d *Driver) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	limit := req.GetMaxEntries()
	if limit < 0 {
		return nil, invalid("max_entries must not be negative")
	}
	all, err := d.records.List()
	if err != nil {
		return nil, err
	}
	vols := slices.DeleteFunc(all, func(v *model.Volume) bool { return !listed(v) })
	rest, _, err := page(vols, func(v *model.Volume) string { return v.ID }, req.GetStartingToken(), 0)
	if err != nil {
		return nil, err
	}
	resp := &csi.ControllerListVolumeHealthResponse{}
	for _, v := range rest {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		h := d.controllerHealth(ctx, v)
		if len(h.HealthStatuses) == 0 {
			continue
		}
		if limit > 0 && len(resp.Entries) == int(limit) {
			resp.NextToken = tokenPrefix + v.ID
			break
		}
		resp.Entries = append(resp.Entries, h)
	}
	return resp, nil
}

// controllerHealth is v's health as the controller on v's node sees it:
// what v's source says of it where it is staged here (the same answer as
// NodeGetVolumeHealth), then the state of its image (recordedImageHealth),
// each (status, reason) once.
func (d *Driver) controllerHealth(ctx context.Context, v *model.Volume) *csi.VolumeHealth {
	var entries []*csi.VolumeHealth_VolumeHealthEntry
	if v.Staged() {
		staged, err := d.sourceHealth(ctx, v)
		if err != nil {
			staged = []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE,
				Reason: "SourceUnavailable", Message: err.Error()}}
		}
		entries = staged
	}
	for _, e := range recordedImageHealth(v) {
		if !slices.ContainsFunc(entries, func(have *csi.VolumeHealth_VolumeHealthEntry) bool {
			return have.GetStatus() == e.GetStatus() && have.GetReason() == e.GetReason()
		}) {
			entries = append(entries, e)
		}
	}
	return &csi.VolumeHealth{VolumeId: v.ID, HealthStatuses: entries}
}

// recordedImageHealth checks v's image at the path its record names,
// without following a symlink there (the plugin makes its images as plain
// files): gone is DATA_LOSS ImageGone (the reason the loop source gives
// for a staged volume, so the two answers merge); shorter than the
// recorded capacity, DATA_LOSS ImageTruncated (the end of the filesystem
// is gone); not a regular file or not statable, INACCESSIBLE. A bigger
// image is normal: an expansion interrupted after the image grew and
// before the record did leaves one, and the retry records it.
func recordedImageHealth(v *model.Volume) []*csi.VolumeHealth_VolumeHealthEntry {
	entry := func(status csi.VolumeHealthErrorType, reason, format string, args ...any) []*csi.VolumeHealth_VolumeHealthEntry {
		return []*csi.VolumeHealth_VolumeHealthEntry{{Status: status, Reason: reason, Message: fmt.Sprintf(format, args...)}}
	}
	fi, err := os.Lstat(v.Image)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return entry(csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone",
			"the image %s of volume %s is gone: its data is lost", v.Image, v.ID)
	case err != nil:
		return entry(csi.VolumeHealthErrorType_INACCESSIBLE, "ImageUnreadable",
			"volume %s: %v", v.ID, err)
	case !fi.Mode().IsRegular():
		return entry(csi.VolumeHealthErrorType_INACCESSIBLE, "ImageNotAFile",
			"the image %s of volume %s is a %s, not a regular file", v.Image, v.ID, fi.Mode().Type())
	case fi.Size() < v.CapacityBytes:
		return entry(csi.VolumeHealthErrorType_DATA_LOSS, "ImageTruncated",
			"the image %s of volume %s holds %d bytes, not the %d recorded: the end of its data is lost", v.Image, v.ID, fi.Size(), v.CapacityBytes)
	}
	return nil
}

// sourceHealth is what the source of v, staged here, says of it as CSI
// health entries: none for a healthy volume or a source that cannot tell,
// INACCESSIBLE for an abnormal one, DATA_LOSS where the source says the
// data goes.
func (d *Driver) sourceHealth(ctx context.Context, v *model.Volume) ([]*csi.VolumeHealth_VolumeHealthEntry, error) {
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	hc, ok := src.(source.HealthChecker)
	if !ok {
		return nil, nil
	}
	h := hc.Health(ctx, viewOf(v))
	if !h.Abnormal {
		return nil, nil
	}
	status := csi.VolumeHealthErrorType_INACCESSIBLE
	if h.DataLoss {
		status = csi.VolumeHealthErrorType_DATA_LOSS
	}
	return []*csi.VolumeHealth_VolumeHealthEntry{{Status: status, Reason: h.Reason, Message: h.Message}}, nil
}
