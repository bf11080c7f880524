package mounter

import (
	"context"
	"fmt"
	"os"

	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
)

var errPending = fmt.Errorf("not moved into the mounter yet: %w", errdefs.ErrUnimplemented)

func (n *Local) StartDaemon(context.Context, DaemonRequest) (DaemonInfo, error) {
	return DaemonInfo{}, errPending
}
func (n *Local) WaitDaemon(context.Context, daemon.Proc) error { return errPending }
func (n *Local) DaemonStatus(context.Context, daemon.Proc, uint64) (DaemonStatus, error) {
	return DaemonStatus{}, errPending
}
func (n *Local) StopDaemons(context.Context, string, []daemon.Proc, bool) error { return errPending }
func (n *Local) ConnectNBD(context.Context, NBDRequest, *os.File) (Device, error) {
	return Device{}, errPending
}
func (n *Local) ReconnectNBD(context.Context, Device, string, *os.File) error { return errPending }
func (n *Local) DisconnectNBD(context.Context, Device, string) error          { return errPending }
func (n *Local) LoginISCSI(context.Context, ISCSILogin) (ISCSISession, error) {
	return ISCSISession{}, errPending
}
func (n *Local) LogoutISCSI(context.Context, ISCSILogout) error { return errPending }
func (n *Local) ownsBlock(uint32, uint32) bool                  { return false }
