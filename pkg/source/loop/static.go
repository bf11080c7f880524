package loop

import (
	"fmt"
	"strings"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/source"
)

// Volume context keys of a static loop volume.
const (
	CtxImage  = "image"
	CtxFsType = "fsType"
)

// NewVolume checks a static loop volume's context: an image under one of
// the admin's roots, an optional fsType, and optional overlay settings.
func (s *Source) NewVolume(id string, vctx map[string]string) (*journal.Volume, error) {
	if vctx[CtxImage] == "" {
		return nil, fmt.Errorf("volume %s does not exist and its context names no image: %w", id, errdefs.ErrNotFound)
	}
	params := map[string]string{}
	for k, val := range vctx {
		switch {
		case k == "type":
		case k == ParamOverlay:
			if val != "true" && val != "false" {
				return nil, fmt.Errorf("%s must be true or false, not %q: %w", k, val, errdefs.ErrInvalidArgument)
			}
			params[k] = val
		case k == ParamUpperSize:
			params[k] = val
		case k == CtxImage || k == CtxFsType || strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return nil, fmt.Errorf("unknown loop volume attribute %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	image, err := ResolveStaticImage(vctx[CtxImage], s.ImageRoots)
	if err != nil {
		return nil, err
	}
	return &journal.Volume{ID: id, Kind: journal.KindStatic, Type: Type, Image: image, FsType: vctx[CtxFsType], Parameters: params}, nil
}
