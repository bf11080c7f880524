package service

import (
	"context"
	"fmt"
	"math"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
)

// SpawnDaemon starts a daemon its policy allows (see policy.Policy.Check).
func (s *server) SpawnDaemon(ctx context.Context, req *api.SpawnDaemonRequest) (*api.SpawnDaemonResponse, error) {
	c := CommandFromProto(req)
	if err := s.daemons.Check(c); err != nil {
		return nil, err
	}
	sp := s.daemons.Spawner
	if sp == nil {
		sp = daemon.LocalSpawner{}
	}
	logger := klog.FromContext(ctx)
	logger.V(5).Info("Starting daemon", "path", c.Path, "args", c.Args, "env", c.Env, "stdin", c.Stdin, "log", c.Log)
	p, err := sp.Spawn(ctx, c)
	if err != nil {
		return nil, err
	}
	logger.V(2).Info("Started daemon", "path", c.Path, "pid", p.PID, "startTime", p.StartTime, "log", c.Log)
	return &api.SpawnDaemonResponse{Pid: int64(p.PID), StartTime: p.StartTime}, nil
}

// CommandToProto converts a daemon's command to its wire form.
func CommandToProto(c daemon.Command) *api.SpawnDaemonRequest {
	r := &api.SpawnDaemonRequest{Path: c.Path, Args: c.Args, Env: c.Env, StdinPath: c.Stdin, LogPath: c.Log}
	if c.RunAs != nil {
		r.RunAs = &api.DaemonUser{Uid: c.RunAs.UID, Gid: c.RunAs.GID}
	}
	return r
}

// CommandFromProto converts a daemon's command from its wire form.
func CommandFromProto(r *api.SpawnDaemonRequest) daemon.Command {
	c := daemon.Command{Path: r.GetPath(), Args: r.GetArgs(), Env: r.GetEnv(), Stdin: r.GetStdinPath(), Log: r.GetLogPath()}
	if u := r.GetRunAs(); u != nil {
		c.RunAs = &daemon.User{UID: u.GetUid(), GID: u.GetGid()}
	}
	return c
}

// NewSpawner returns a daemon.Spawner that has the Mounter service (the
// sidecar's `serve`) start daemons, in the sidecar's container. Errors wrap
// the errdefs sentinel of their status code.
func NewSpawner(cc grpc.ClientConnInterface) daemon.Spawner {
	return &spawner{c: api.NewMounterClient(cc)}
}

type spawner struct{ c api.MounterClient }

func (s *spawner) Spawn(ctx context.Context, c daemon.Command) (daemon.Proc, error) {
	resp, err := s.c.SpawnDaemon(ctx, CommandToProto(c))
	if err != nil {
		return daemon.Proc{}, fmt.Errorf("mounter: %w", errdefs.FromGRPC(err))
	}
	if resp.GetPid() <= 0 || resp.GetPid() > math.MaxInt32 {
		return daemon.Proc{}, fmt.Errorf("the mounter answered pid %d for %s: %w", resp.GetPid(), c.Path, errdefs.ErrUnavailable)
	}
	return daemon.Proc{PID: int(resp.GetPid()), StartTime: resp.GetStartTime()}, nil
}
