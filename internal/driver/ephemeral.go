package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/klog/v2"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// DefaultEphemeralSize is the image size of an inline volume without a
// size attribute.
const DefaultEphemeralSize int64 = 1 << 30

// publishEphemeral creates, stages and publishes an inline volume in one
// go: kubelet sends no CreateVolume or NodeStageVolume for it. Any failure
// undoes every step, so a failed publish leaves no image behind.
func (d *Driver) publishEphemeral(ctx context.Context, req *csi.NodePublishVolumeRequest, c capability) (err error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	v, err := d.records.Get(id)
	if err == nil {
		if v.Kind != model.KindEphemeral {
			return fmt.Errorf("volume %s exists and is not an inline volume: %w", id, errdefs.ErrAlreadyExists)
		}
		return d.publish(ctx, v, target, c, req.GetReadonly())
	}
	if !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	typ, prov, size, fsType, err := d.parseEphemeral(req.GetVolumeContext(), c)
	if err != nil {
		return err
	}
	if c.readOnly {
		return invalid("an inline volume starts empty, so a read-only access mode makes no sense")
	}
	if err := d.checkFits(id, size); err != nil {
		return err
	}
	v = &model.Volume{ID: id, Kind: model.KindEphemeral, Type: typ, FsType: fsType, CapacityBytes: size,
		Image: prov.ImagePath(model.KindEphemeral, id), Creating: true}
	if err := d.records.Put(v, journal.Durable); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.destroyEphemeral(ctx, v))
		}
	}()
	if _, err := prov.CreateImage(ctx, v.Image, size, ""); err != nil {
		return imageError(err)
	}
	v.Creating = false
	if err := d.stage(ctx, v, d.opts.StateDir, c, nil, nil); err != nil {
		return err
	}
	return d.publish(ctx, v, target, c, req.GetReadonly())
}

func (d *Driver) parseEphemeral(vctx map[string]string, c capability) (typ string, prov source.Provisioner, size int64, fsType string, err error) {
	typ, size = cmp.Or(vctx[ctxType], d.opts.DefaultType), DefaultEphemeralSize
	fsType = cmp.Or(c.fsType, d.opts.Config.DefaultFsType)
	for k, val := range vctx {
		switch {
		case k == ctxType:
		case k == ctxSize:
			if size, err = parseSize(val); err != nil {
				return "", nil, 0, "", err
			}
		case k == ctxFsType:
			fsType = val
		case k == ctxNRI: // read by publish
		case strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return "", nil, 0, "", invalid("unknown inline volume attribute %q", k)
		}
	}
	var ok bool
	if prov, ok = d.provisioner(typ); !ok {
		return "", nil, 0, "", invalid("inline volume type %q is not supported (supported: %s)", typ, d.provisionerTypes())
	}
	if err := checkFormattable(fsType); err != nil {
		return "", nil, 0, "", err
	}
	return typ, prov, roundCapacity(size, fsType), fsType, nil
}

// destroyEphemeral tears down an inline volume: unstage, image, record.
func (d *Driver) destroyEphemeral(ctx context.Context, v *model.Volume) error {
	if len(v.Publishes) > 0 {
		return d.records.Put(v, journal.Runtime)
	}
	if err := d.unstage(ctx, v); err != nil {
		return err
	}
	if err := d.removeImage(v); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Inline volume removed", "volume", v.ID)
	return d.records.Delete(v.ID, journal.Durable)
}

// parseSize reads a byte count with an optional binary (Ki, Mi, Gi, Ti) or
// decimal (k, M, G, T) suffix, as Kubernetes quantities write them.
func parseSize(s string) (int64, error) {
	units := []struct {
		suffix string
		mult   int64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}}
	mult := int64(1)
	num := s
	for _, u := range units {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			num, mult = n, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 || n > (1<<50)/mult {
		return 0, invalid("size %q must be a positive byte count such as 512Mi or 2Gi", s)
	}
	return n * mult, nil
}
