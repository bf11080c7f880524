package nri

import (
	"fmt"
	"path"
	"slices"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/pkg/plan"
)

// ociMounts turns a plan performed at dest (a path inside the container)
// into the container's OCI mounts, which the runtime then mounts inside the
// container's namespace, in the plan's order (the runtime sorts mounts by
// depth, and a plan's targets only ever nest below its mount point).
//
// A bind descriptor becomes an OCI "bind" mount: runtimes need the "bind"
// (or "rbind" when the plan asks for "rec") option to know it is one.
// Propagation is always private: the volume must not leak out of the
// container, nor anything into it.
func ociMounts(dest string, mounts []plan.Mount) ([]*nriapi.Mount, error) {
	out := make([]*nriapi.Mount, 0, len(mounts))
	for i, m := range mounts {
		if m.IsDeviceBind() {
			return nil, fmt.Errorf("mount %d binds device %s: block volumes reach a container as a device, not a mount", i, m.Source)
		}
		opts := slices.DeleteFunc(slices.Clone(m.Options), func(o string) bool { return o == "rec" })
		if m.Type == plan.TypeBind {
			bind := "bind"
			if m.HasOption("rec") {
				bind = "rbind"
			}
			opts = append([]string{bind}, opts...)
		}
		opts = append(opts, "rprivate")
		out = append(out, &nriapi.Mount{
			Destination: path.Join(dest, m.Target),
			Type:        m.Type,
			Source:      m.Source,
			Options:     opts,
		})
	}
	return out, nil
}

// readOnly reports whether a container mount is read-only: kubelet's
// readOnly volume mounts reach the runtime as "ro" (or "rro").
func readOnly(m *nriapi.Mount) bool {
	return slices.Contains(m.Options, "ro") || slices.Contains(m.Options, "rro")
}
