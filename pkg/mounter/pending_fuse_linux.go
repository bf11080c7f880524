package mounter

// Not moved into the mounter yet: FUSE daemons (pkg/source/fuse still runs
// them itself). Replace this file.

import (
	"context"
	"fmt"

	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
)

var errFusePending = fmt.Errorf("FUSE daemons are not run by the mounter yet: %w", errdefs.ErrUnimplemented)

// daemonsState is what the node keeps of the FUSE daemons it runs.
type daemonsState struct{}

// initDaemons takes back the records of the daemons after a restart.
func (n *Local) initDaemons(context.Context) error { return nil }

func (n *Local) StartDaemon(context.Context, DaemonRequest) (DaemonInfo, error) {
	return DaemonInfo{}, errFusePending
}
func (n *Local) WaitDaemon(context.Context, daemon.Proc) error { return errFusePending }
func (n *Local) DaemonStatus(context.Context, daemon.Proc, uint64) (DaemonStatus, error) {
	return DaemonStatus{}, errFusePending
}
func (n *Local) StopDaemons(context.Context, string, []daemon.Proc, bool) error {
	return errFusePending
}
