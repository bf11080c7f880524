package nri

import (
	"context"
	"fmt"
	"path"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// PlanChecker checks a plan the runtime is to perform, as the mounter
// checks one it performs itself (mounter.Local.CheckPlan).
type PlanChecker interface {
	CheckPlan(ctx context.Context, mounts []plan.Mount) error
}

// checkedPlan is a plan the mounter checked: what ociMounts and
// sharedReadOnly take, so that the runtime, which mounts as root whatever
// it is handed, gets no mount the mounter did not check, and no device a
// plan names is opened before the mounter has checked it.
type checkedPlan struct{ mounts []plan.Mount }

// checked has the mounter check the plugin's plan before anything of it
// reaches the runtime. A hook whose mounter cannot check (Plans unset)
// refuses every plan: the plugin's answer is never trusted as it came.
func (h *Hook) checked(ctx context.Context, mounts []plan.Mount) (checkedPlan, error) {
	if h.Plans == nil {
		return checkedPlan{}, fmt.Errorf("no mounter checks the plans the runtime would perform: %w", errdefs.ErrPermissionDenied)
	}
	if err := h.Plans.CheckPlan(ctx, mounts); err != nil {
		return checkedPlan{}, fmt.Errorf("the mounter refuses the plan: %w", err)
	}
	return checkedPlan{mounts: mounts}, nil
}

// ociMounts turns a plan performed at dest (a path inside the container)
// into the container's OCI mounts, which the runtime then mounts inside the
// container's namespace, in the plan's order (the runtime sorts mounts by
// depth, and a plan's targets only ever nest below its mount point).
//
// A bind descriptor becomes an OCI "bind" mount: runtimes need the "bind"
// (or "rbind" when the plan asks for "rec", which the mounter's policy
// refuses: an rbind takes submounts nobody checked) option to know it is
// one.
// Propagation is always private: the volume must not leak out of the
// container, nor anything into it.
func ociMounts(dest string, p checkedPlan) ([]*nriapi.Mount, error) {
	out := make([]*nriapi.Mount, 0, len(p.mounts))
	for i, m := range p.mounts {
		if m.IsDeviceBind() {
			return nil, fmt.Errorf("mount %d binds device %s: block volumes reach a container as a device, not a mount: %w", i, m.Source, errdefs.ErrInvalidArgument)
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
// It opens the plan's devices: only a checked plan's, which are devices the
// mounter set up (opening another, /dev/watchdog, could already act).
func sharedReadOnly(p checkedPlan) bool {
	for _, m := range p.mounts {
		if m.Type != plan.TypeBind && m.HasOption("ro") && strings.HasPrefix(m.Source, "/dev/") && !mountns.ReadOnlyDevice(m.Source) {
			return true
		}
	}
	return false
}
