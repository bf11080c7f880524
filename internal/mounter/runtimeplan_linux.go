package mounter

import (
	"context"

	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// CheckPlan checks a plan that someone else performs: the container
// runtime, to which the NRI hook hands a plan as a container's OCI mounts
// and which mounts them as root. It runs the checks Mount runs on a plan
// (the mounter's own policy: types, targets, nosuid and nodev, no
// recursive bind; each source opened through the same checks: a device the
// mounter set up, a bind source it made below the state dir) without
// mounting, and closes what it opened.
//
// The sources are checked, not pinned: the runtime opens them again by
// path, later.
func (n *Local) CheckPlan(ctx context.Context, mounts []plan.Mount) error {
	if err := checkNotCanceled(ctx); err != nil {
		return err
	}
	if err := n.exec.Policy.Validate(mounts); err != nil {
		return err
	}
	srcs, err := n.exec.openSources(mounts)
	closeAll(srcs)
	if err != nil {
		return err
	}
	// The runtime mounts with the options as they are: an SELinux label
	// is checked here as the mounter checks its own mounts' (mountns).
	// After the sources: parsing "ro" opens a /dev source to ask whether
	// the device is read-only, which only a device the mounter set up may
	// be (opening a watchdog arms it).
	for _, m := range mounts {
		if err := mountns.CheckOptions(m); err != nil {
			return err
		}
	}
	return nil
}
