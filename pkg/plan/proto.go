package plan

import (
	"slices"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// ToProto converts a plan to its wire form.
func ToProto(mounts []Mount) []*api.Mount {
	out := make([]*api.Mount, 0, len(mounts))
	for _, m := range mounts {
		out = append(out, &api.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: slices.Clone(m.Options)})
	}
	return out
}

// FromProto converts a plan from its wire form. Nil entries are skipped; a
// plan that ends up empty fails Validate.
func FromProto(in []*api.Mount) []Mount {
	out := make([]Mount, 0, len(in))
	for _, m := range in {
		if m == nil {
			continue
		}
		out = append(out, Mount{Type: m.GetType(), Source: m.GetSource(), Target: m.GetTarget(), Options: slices.Clone(m.GetOptions())})
	}
	return out
}
