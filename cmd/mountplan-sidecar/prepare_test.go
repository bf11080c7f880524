package main

import (
	"context"
	"errors"
	"fmt"
	"testing"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/mountplan/mountplan/internal/errdefs"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// plugin is a NodePrepareClient that answers with a fixed plan and records
// the requests it gets.
type plugin struct {
	api.NodePrepareClient // what the prepare flow does not call
	mounts                []plan.Mount
	inode, id             uint64
	prepared              *api.NodePrepareVolumeRequest
	unprepared            []*api.NodeUnprepareVolumeRequest
}

func (p *plugin) NodePrepareVolume(_ context.Context, req *api.NodePrepareVolumeRequest, _ ...grpc.CallOption) (*api.NodePrepareVolumeResponse, error) {
	p.prepared = req
	c := *req.GetConsumer()
	c.MntNsInode, c.MntNsId = p.inode, p.id
	return &api.NodePrepareVolumeResponse{Mounts: plan.ToProto(p.mounts), Consumer: &c}, nil
}

func (p *plugin) NodeUnprepareVolume(_ context.Context, req *api.NodeUnprepareVolumeRequest, _ ...grpc.CallOption) (*api.NodeUnprepareVolumeResponse, error) {
	p.unprepared = append(p.unprepared, req)
	return &api.NodeUnprepareVolumeResponse{}, nil
}

// fakeMounter records the consumer of the last plan and answers with err.
type fakeMounter struct {
	err      error
	consumer plan.Consumer
}

func (m *fakeMounter) Mount(_ context.Context, _ []plan.Mount, c plan.Consumer) error {
	m.consumer = c
	return m.err
}

func (m *fakeMounter) Unmount(_ context.Context, _ []plan.Mount, c plan.Consumer) error {
	m.consumer = c
	return m.err
}

type fakeTreeUnmounter struct {
	err error
	got plan.Consumer
}

func (u *fakeTreeUnmounter) UnmountAll(_ context.Context, c plan.Consumer) error {
	u.got = c
	return u.err
}

func TestPrepareAndMount(t *testing.T) {
	rw := []plan.Mount{{Type: "tmpfs", Source: "v", Options: []string{"nosuid", "nodev"}}}
	ro := []plan.Mount{{Type: "tmpfs", Source: "v", Options: []string{"nosuid", "nodev", "ro"}}}
	tests := []struct {
		name     string
		readOnly bool
		block    bool
		plan     []plan.Mount
		mountErr error
		want     error
		released bool
	}{
		{name: "performed", plan: rw},
		{name: "read-only block", readOnly: true, block: true, plan: ro},
		{name: "mount fails: claim released", plan: rw, mountErr: fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition),
			want: errdefs.ErrFailedPrecondition, released: true},
		{name: "writable plan for read-only request", readOnly: true, plan: rw, want: errdefs.ErrInvalidArgument, released: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &plugin{mounts: tt.plan, inode: 4026532000, id: 9}
			m := &fakeMounter{err: tt.mountErr}
			r := mountRequest{VolumeID: "vol-1", StagingPath: "/var/lib/mountplan/staging/vol-1",
				ReadOnly: tt.readOnly, Block: tt.block, Consumer: plan.Consumer{PID: 42, MountPoint: "/data"}}
			c, err := prepareAndMount(context.Background(), p, m, r)
			if !errors.Is(err, tt.want) {
				t.Fatalf("prepareAndMount = %v, want %v", err, tt.want)
			}
			want := plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 4026532000, ID: 9}}
			if c != want {
				t.Fatalf("consumer = %+v, want %+v", c, want)
			}
			if tt.plan != nil && tt.mountErr == nil && !tt.released && m.consumer != want {
				t.Fatalf("plan performed at %+v, want the consumer the plugin recorded %+v", m.consumer, want)
			}
			checkPrepareRequest(t, p.prepared, tt.readOnly, tt.block)
			if got := len(p.unprepared) == 1; got != tt.released {
				t.Fatalf("claim released: %v, want %v", got, tt.released)
			}
			if tt.released && (p.unprepared[0].GetConsumer().GetMntNsInode() != want.Namespace.Inode || p.unprepared[0].GetConsumer().GetMntNsId() != want.Namespace.ID) {
				t.Fatalf("released consumer %v, want the recorded one", p.unprepared[0].GetConsumer())
			}
		})
	}
}

func checkPrepareRequest(t *testing.T, req *api.NodePrepareVolumeRequest, readOnly, block bool) {
	t.Helper()
	mode := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	if readOnly {
		mode = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	}
	vc := req.GetVolumeCapability()
	if req.GetVolumeId() != "vol-1" || req.GetReadonly() != readOnly || vc.GetAccessMode().GetMode() != mode ||
		(vc.GetBlock() != nil) != block || (vc.GetMount() != nil) == block || req.GetConsumer().GetPid() != 42 {
		t.Fatalf("NodePrepareVolume request = %v", req)
	}
}

func TestUnmountAndRelease(t *testing.T) {
	c := plan.Consumer{PID: 42, MountPoint: "/data"}
	p := &plugin{}
	u := &fakeTreeUnmounter{}
	if err := unmountAndRelease(context.Background(), p, u, "vol-1", c); err != nil {
		t.Fatal(err)
	}
	if u.got != c || len(p.unprepared) != 1 || p.unprepared[0].GetVolumeId() != "vol-1" {
		t.Fatalf("unmounted %+v, released %v", u.got, p.unprepared)
	}

	// While something is still mounted, the claim is kept.
	p = &plugin{}
	u = &fakeTreeUnmounter{err: fmt.Errorf("busy: %w", errdefs.ErrFailedPrecondition)}
	if err := unmountAndRelease(context.Background(), p, u, "vol-1", c); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Unprepare = %v, want FailedPrecondition", err)
	}
	if len(p.unprepared) != 0 {
		t.Fatal("claim released while still mounted")
	}
}
