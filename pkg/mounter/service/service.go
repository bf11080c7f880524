// Package service is the Mounter gRPC service (served by
// `mountplan-sidecar serve`) and its clients: NewServer and Serve put an
// executor (mounter.Interface) and a daemon policy on a socket; NewClient
// and NewSpawner are what the plugin uses in their place. Errors become
// status codes in one place, Interceptor, and come back to the client as
// the same errdefs sentinels.
package service

import (
	"context"
	"fmt"

	"google.golang.org/grpc"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/daemon/policy"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// NewServer serves m as the Mounter gRPC service; its errors become status
// codes in Interceptor, which Serve installs. SpawnDaemon is refused unless
// an option gives it a policy (WithDaemons).
func NewServer(m mounter.Interface, opts ...ServerOption) api.MounterServer {
	s := &server{m: m}
	for _, o := range opts {
		o(s)
	}
	return s
}

// ServerOption configures NewServer and Serve.
type ServerOption func(*server)

// WithDaemons has SpawnDaemon start the daemons p allows.
func WithDaemons(p *policy.Policy) ServerOption { return func(s *server) { s.daemons = p } }

type server struct {
	api.UnimplementedMounterServer
	m       mounter.Interface
	daemons *policy.Policy
}

func (s *server) Mount(ctx context.Context, req *api.MountRequest) (*api.MountResponse, error) {
	c, err := plan.ConsumerFromProto(req.GetConsumer())
	if err == nil {
		err = s.m.Mount(ctx, plan.FromProto(req.GetMounts()), c)
	}
	if err != nil {
		return nil, err
	}
	return &api.MountResponse{}, nil
}

func (s *server) Unmount(ctx context.Context, req *api.UnmountRequest) (*api.UnmountResponse, error) {
	c, err := plan.ConsumerFromProto(req.GetConsumer())
	if err == nil {
		err = s.m.Unmount(ctx, plan.FromProto(req.GetMounts()), c)
	}
	if err != nil {
		return nil, err
	}
	return &api.UnmountResponse{}, nil
}

// HealFuse is served when the executor can heal (mounter.Healer);
// otherwise it is Unimplemented, as on a mounter of an earlier version.
func (s *server) HealFuse(ctx context.Context, req *api.HealFuseRequest) (*api.HealFuseResponse, error) {
	h, ok := s.m.(mounter.Healer)
	if !ok {
		return nil, fmt.Errorf("this mounter cannot heal FUSE mounts: %w", errdefs.ErrUnimplemented)
	}
	heal, err := plan.HealFromProto(req)
	if err != nil {
		return nil, err
	}
	res, err := h.HealFuse(ctx, heal)
	if err != nil {
		return nil, err
	}
	return plan.HealResultToProto(res), nil
}

// NewClient returns an Interface that performs plans through a Mounter
// service (the sidecar's `serve`); it is a mounter.Healer too. Errors wrap
// the errdefs sentinel of their status code, so errors.Is works as with
// the in-process Executor.
func NewClient(cc grpc.ClientConnInterface) mounter.Interface {
	return &client{c: api.NewMounterClient(cc)}
}

var _ mounter.Healer = (*client)(nil)

type client struct{ c api.MounterClient }

func (c *client) Mount(ctx context.Context, mounts []plan.Mount, consumer plan.Consumer) error {
	_, err := c.c.Mount(ctx, &api.MountRequest{Mounts: plan.ToProto(mounts), Consumer: plan.ConsumerToProto(consumer)})
	return errdefs.FromGRPC(err)
}

func (c *client) Unmount(ctx context.Context, mounts []plan.Mount, consumer plan.Consumer) error {
	_, err := c.c.Unmount(ctx, &api.UnmountRequest{Mounts: plan.ToProto(mounts), Consumer: plan.ConsumerToProto(consumer)})
	return errdefs.FromGRPC(err)
}

func (c *client) HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error) {
	resp, err := c.c.HealFuse(ctx, plan.HealToProto(h))
	if err != nil {
		return plan.HealResult{}, errdefs.FromGRPC(err)
	}
	return plan.HealResultFromProto(resp), nil
}
