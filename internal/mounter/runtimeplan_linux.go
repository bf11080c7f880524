package mounter

import (
	"context"
	"fmt"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// CheckPlan checks a plan that someone else performs: the container
// runtime, to which the NRI hook hands a plan as a container's OCI mounts
// and which mounts them as root. It runs the checks Mount runs on a plan
// (the mounter's own policy, its targets, nosuid and nodev, each source
// opened through the same checks: a device the mounter set up, a bind
// source it made below the state dir) without mounting, and closes what it
// opened. A recursive bind is refused besides: the runtime's rbind takes
// every mount below the source, which the mounter cannot vouch for, and no
// plan of the plugin's has one.
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
	for i, m := range mounts {
		if m.HasOption("rec") {
			return fmt.Errorf("mount %d: recursive %s of %s: the runtime would take every mount below it: %w", i, m.Type, m.Source, errdefs.ErrPermissionDenied)
		}
	}
	srcs, err := n.exec.openSources(mounts)
	closeAll(srcs)
	return err
}
