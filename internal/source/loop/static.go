package loop

import (
	"fmt"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// Volume context keys of a static loop volume.
const (
	CtxImage  = "image"
	CtxFsType = "fsType"
)

// NewVolume checks a static loop volume's context: an image under one of
// the admin's roots, an optional fsType, and optional overlay settings.
func (s *Source) NewVolume(id string, vctx map[string]string) (source.Volume, error) {
	if vctx[CtxImage] == "" {
		return source.Volume{}, fmt.Errorf("volume %s does not exist and its context names no image: %w", id, errdefs.ErrNotFound)
	}
	params := map[string]string{}
	for k, val := range vctx {
		switch {
		case k == "type":
		case k == ParamOverlay:
			if val != "true" && val != "false" {
				return source.Volume{}, fmt.Errorf("%s must be true or false, not %q: %w", k, val, errdefs.ErrInvalidArgument)
			}
			params[k] = val
		case k == ParamUpperSize:
			params[k] = val
		case k == CtxImage || k == CtxFsType || strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return source.Volume{}, fmt.Errorf("unknown loop volume attribute %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	image, err := ResolveStaticImage(vctx[CtxImage], s.ImageRoots)
	if err != nil {
		return source.Volume{}, err
	}
	return source.Volume{ID: id, Kind: model.KindStatic, Image: image, FsType: vctx[CtxFsType], Parameters: params}, nil
}
