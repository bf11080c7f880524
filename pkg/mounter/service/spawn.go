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

// SpawnDaemon starts the daemon its policy renders for the request (see
// policy.Policy.Command); nothing of the command line comes from the caller.
func (s *server) SpawnDaemon(ctx context.Context, req *api.SpawnDaemonRequest) (*api.SpawnDaemonResponse, error) {
	spec := SpecFromProto(req)
	c, p, err := s.daemons.Spawn(ctx, spec)
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).V(2).Info("Started daemon", "profile", spec.Profile, "path", c.Path, "pid", p.PID, "startTime", p.StartTime, "log", c.Log)
	return &api.SpawnDaemonResponse{Pid: int64(p.PID), StartTime: p.StartTime}, nil
}

// SpecToProto converts a daemon's spec to its wire form.
func SpecToProto(s daemon.Spec) *api.SpawnDaemonRequest {
	return &api.SpawnDaemonRequest{
		Profile: s.Profile, Parameters: s.Params, ReadOnly: s.ReadOnly, Secrets: s.Secrets,
		Paths: &api.DaemonPaths{MountPoint: s.Paths.MountPoint, WorkDir: s.Paths.WorkDir, SecretsDir: s.Paths.SecretsDir, Log: s.Paths.Log},
	}
}

// SpecFromProto converts a daemon's spec from its wire form.
func SpecFromProto(r *api.SpawnDaemonRequest) daemon.Spec {
	p := r.GetPaths()
	return daemon.Spec{
		Profile: r.GetProfile(), Params: r.GetParameters(), ReadOnly: r.GetReadOnly(), Secrets: r.GetSecrets(),
		Paths: daemon.Paths{MountPoint: p.GetMountPoint(), WorkDir: p.GetWorkDir(), SecretsDir: p.GetSecretsDir(), Log: p.GetLog()},
	}
}

// NewSpawner returns a daemon.Spawner that has the Mounter service (the
// sidecar's `serve`) start daemons, in the sidecar's container. It sends
// only a command's Spec: the mounter renders the command again from its
// own profiles. Errors wrap the errdefs sentinel of their status code.
func NewSpawner(cc grpc.ClientConnInterface) daemon.Spawner {
	return &spawner{c: api.NewMounterClient(cc)}
}

type spawner struct{ c api.MounterClient }

func (s *spawner) Spawn(ctx context.Context, c daemon.Command) (daemon.Proc, error) {
	if c.Spec == nil {
		return daemon.Proc{}, fmt.Errorf("the mounter starts only daemons of a profile, and the command of %s names none "+
			"(recorded by an older plugin: unstage and stage the volume again): %w", c.Path, errdefs.ErrFailedPrecondition)
	}
	resp, err := s.c.SpawnDaemon(ctx, SpecToProto(*c.Spec))
	if err != nil {
		return daemon.Proc{}, fmt.Errorf("mounter: %w", errdefs.FromGRPC(err))
	}
	if resp.GetPid() <= 0 || resp.GetPid() > math.MaxInt32 {
		return daemon.Proc{}, fmt.Errorf("the mounter answered pid %d for %s: %w", resp.GetPid(), c.Path, errdefs.ErrUnavailable)
	}
	return daemon.Proc{PID: int(resp.GetPid()), StartTime: resp.GetStartTime()}, nil
}
