package fuse

import (
	"context"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/mounter"
)

// reasonDaemons is a mounter that says why a daemon died.
type reasonDaemons struct {
	fakeDaemons
	st  mounter.DaemonStatus
	err error
}

func (r *reasonDaemons) DaemonStatus(context.Context, daemon.Proc, uint64) (mounter.DaemonStatus, error) {
	return r.st, r.err
}

// TestWhyExited: a daemon the mounter says the OOM killer took is
// OOMKilled, with the mounter's detail; any other death is DaemonDown.
func TestWhyExited(t *testing.T) {
	d := Daemon{Proc: daemon.Proc{PID: 4242, StartTime: 1}}
	for name, tt := range map[string]struct {
		st                mounter.DaemonStatus
		reason, inMessage string
	}{
		"oom killed": {mounter.DaemonStatus{Reason: mounter.ReasonOOMKilled, Detail: "killed at memory.max 33554432"}, "OOMKilled", "memory.max 33554432"},
		"crashed":    {mounter.DaemonStatus{}, "DaemonDown", "exited"},
	} {
		sup := &supervisor{src: &Source{daemons: &reasonDaemons{st: tt.st}}}
		reason, msg := sup.whyExited(context.Background(), d)
		if reason != tt.reason || !strings.Contains(msg, tt.inMessage) {
			t.Errorf("%s: whyExited = %q, %q", name, reason, msg)
		}
	}
}
