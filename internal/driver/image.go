package driver

import (
	"context"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// makeImage makes a provisioned volume's image. For a volume asked for with
// mount access only, the filesystem is made here, on the image file before
// it gets its name, and recorded as done with the image: the first stage
// then costs what any later stage does (no blkid probe, no mkfs), instead
// of ten times as much. A volume that may be used as a raw block device
// gets a blank image, and its first stage with mount access probes and
// formats as before; a stage never formats an image that holds a
// filesystem.
func makeImage(ctx context.Context, prov source.Provisioner, v *model.Volume, caps []*csi.VolumeCapability) error {
	fsType := v.FsType
	if slices.ContainsFunc(caps, func(c *csi.VolumeCapability) bool { return c.GetBlock() != nil }) {
		fsType = ""
	}
	made, err := prov.CreateImage(ctx, v.Image, v.CapacityBytes, fsType)
	if made && err == nil && fsType != "" {
		v.Format = &model.Format{FsType: v.FsType, Done: true}
	}
	return err
}
