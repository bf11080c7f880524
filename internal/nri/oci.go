package nri

import (
	"fmt"
	"path"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/mountns"
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

// sharedReadOnly reports whether the plan mounts, read-only, a filesystem
// of a writable device. Its superblock is shared with the volume's other
// consumers, writable ones too, so it can only be read-only per mount
// (mount_setattr, as internal/mountns does). OCI runtimes cannot say that for a
// new filesystem mount: "ro" reaches the mount call, which then fails
// (EBUSY) while a writable consumer exists, and runc ignores "rro" there,
// leaving the mount writable. Such plans are performed by the mounter.
func sharedReadOnly(mounts []plan.Mount) bool {
	for _, m := range mounts {
		if m.Type != plan.TypeBind && m.HasOption("ro") && strings.HasPrefix(m.Source, "/dev/") && !mountns.ReadOnlyDevice(m.Source) {
			return true
		}
	}
	return false
}
