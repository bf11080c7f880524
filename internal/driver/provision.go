package driver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// Capacity is provisioned in whole MiB; a request of 0 gets DefaultCapacity.
const (
	CapacityUnit    int64 = 1 << 20
	DefaultCapacity int64 = 1 << 30
)

// minCapacity is the smallest image each filesystem can be made on.
var minCapacity = map[string]int64{"ext4": 16 << 20, "xfs": 300 << 20}

// DefaultEphemeralSize is the image size of an inline volume without a
// size attribute.
const DefaultEphemeralSize int64 = 1 << 30

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
