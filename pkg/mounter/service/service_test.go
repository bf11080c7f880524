package service_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/endpoint"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/mounter/service"
	"github.com/mountplan/mountplan/pkg/plan"
)

// recorder is a mounter.Interface that records what reaches it and answers
// with err.
type recorder struct {
	mu       sync.Mutex
	mounts   []plan.Mount
	consumer plan.Consumer
	err      error
}

func (r *recorder) Mount(_ context.Context, m []plan.Mount, c plan.Consumer) error {
	return r.record(m, c)
}

func (r *recorder) Unmount(_ context.Context, m []plan.Mount, c plan.Consumer) error {
	return r.record(m, c)
}

func (r *recorder) record(m []plan.Mount, c plan.Consumer) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mounts, r.consumer = m, c
	return r.err
}

// serve runs the Mounter service for m on a socket in a temp dir and
// returns a client connection to it.
func serve(t *testing.T, m mounter.Interface) (mounter.Interface, api.MounterClient) {
	conn := serveConn(t, m)
	return service.NewClient(conn), api.NewMounterClient(conn)
}

// serveConn serves m with opts until the test ends and dials it.
func serveConn(t *testing.T, m mounter.Interface, opts ...service.ServerOption) *grpc.ClientConn {
	t.Helper()
	ep := "unix://" + filepath.Join(t.TempDir(), "mounter.sock")
	l, err := endpoint.Listen(ep)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- service.Serve(ctx, l, m, opts...) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	conn, err := endpoint.Dial(ep)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestGRPCRoundTrip(t *testing.T) {
	rec := &recorder{}
	client, _ := serve(t, rec)
	mounts := []plan.Mount{
		{Type: "ext4", Source: "/dev/loop7", Options: []string{"ro", "nosuid", "nodev"}},
		{Type: "bind", Source: "/var/lib/mountplan/x", Target: "data"},
	}
	c := plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 4026531840, ID: 7}}
	for name, call := range map[string]func(context.Context, []plan.Mount, plan.Consumer) error{
		"Mount": client.Mount, "Unmount": client.Unmount,
	} {
		if err := call(context.Background(), mounts, c); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !reflect.DeepEqual(rec.mounts, mounts) || rec.consumer != c {
			t.Fatalf("%s: server got %v %+v, want %v %+v", name, rec.mounts, rec.consumer, mounts, c)
		}
	}
}

func TestGRPCErrorsKeepTheirCodes(t *testing.T) {
	tests := []struct {
		err      error
		code     codes.Code
		sentinel error
	}{
		{fmt.Errorf("target: %w", errdefs.ErrInvalidArgument), codes.InvalidArgument, errdefs.ErrInvalidArgument},
		{fmt.Errorf("pid 7: %w", errdefs.ErrNotFound), codes.NotFound, errdefs.ErrNotFound},
		{fmt.Errorf("namespace: %w", errdefs.ErrFailedPrecondition), codes.FailedPrecondition, errdefs.ErrFailedPrecondition},
		{fmt.Errorf("busy: %w", errdefs.ErrAborted), codes.Aborted, errdefs.ErrAborted},
		{errors.New("boom"), codes.Internal, nil},
	}
	for _, tt := range tests {
		t.Run(tt.code.String(), func(t *testing.T) {
			client, _ := serve(t, &recorder{err: tt.err})
			err := client.Mount(context.Background(), []plan.Mount{{Type: "tmpfs"}}, plan.Consumer{MountPoint: "/x"})
			if errdefs.Code(err) != tt.code {
				t.Fatalf("code = %v (%v), want %v", errdefs.Code(err), err, tt.code)
			}
			if tt.sentinel != nil && !errors.Is(err, tt.sentinel) {
				t.Fatalf("%v does not wrap %v", err, tt.sentinel)
			}
			// Internal has no sentinel: the status error itself comes back.
			if !strings.HasSuffix(err.Error(), tt.err.Error()) {
				t.Fatalf("message = %q, want %q", err, tt.err)
			}
		})
	}
}

func TestGRPCWithoutConsumer(t *testing.T) {
	_, raw := serve(t, &recorder{})
	_, err := raw.Mount(context.Background(), &api.MountRequest{})
	if errdefs.Code(err) != codes.InvalidArgument {
		t.Fatalf("Mount without consumer = %v, want InvalidArgument", err)
	}
	_, err = raw.Unmount(context.Background(), &api.UnmountRequest{Consumer: &api.Consumer{Pid: 1 << 40, MountPoint: "/x"}})
	if errdefs.Code(err) != codes.InvalidArgument {
		t.Fatalf("Unmount with pid out of range = %v, want InvalidArgument", err)
	}
}

// panicker panics on Mount: a bug in a handler must not kill the mounter.
type panicker struct{ recorder }

func (p *panicker) Mount(context.Context, []plan.Mount, plan.Consumer) error {
	panic("boom")
}

func TestServerRecoversFromPanics(t *testing.T) {
	client, _ := serve(t, &panicker{})
	c := plan.Consumer{PID: 1, MountPoint: "/data"}
	mounts := []plan.Mount{{Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev"}}}
	if err := client.Mount(context.Background(), mounts, c); errdefs.Code(err) != codes.Internal {
		t.Fatalf("Mount with a panicking handler: %v, want Internal", err)
	}
	if err := client.Unmount(context.Background(), mounts, c); err != nil {
		t.Fatalf("the server did not survive the panic: %v", err)
	}
}

// healer is a recorder that heals: it keeps the request and answers with
// res and err.
type healer struct {
	recorder
	got plan.Heal
	res plan.HealResult
}

func (h *healer) HealFuse(_ context.Context, req plan.Heal) (plan.HealResult, error) {
	h.got = req
	return h.res, h.err
}

// HealFuse crosses the wire intact both ways; a malformed request never
// reaches the executor; an executor that cannot heal answers Unimplemented
// (a mounter of an earlier version does too), which the client passes on
// as errdefs.ErrUnimplemented for the plugin to fall back.
func TestHealFuseRoundTrip(t *testing.T) {
	ctx := context.Background()
	want := plan.HealResult{
		Healed: []plan.StaleMount{{Namespace: plan.Namespace{Inode: 4026532000, ID: 77}, PID: 42, MountPoint: "/data", Conn: 61}},
		Left:   []plan.StaleMount{{Namespace: plan.Namespace{Inode: 4026531840}, PID: 1, MountPoint: "/srv/x", Conn: 61, Reason: "outside kubelet's directory"}},
	}
	h := &healer{res: want}
	c, _ := serve(t, h)
	req := plan.Heal{Dead: []uint64{61, 62}, Source: "/var/lib/mountplan/fuse/v/mnt"}
	got, err := c.(mounter.Healer).HealFuse(ctx, req)
	if err != nil || !reflect.DeepEqual(got, want) || !reflect.DeepEqual(h.got, req) {
		t.Fatalf("HealFuse: %+v, %v; the executor got %+v", got, err, h.got)
	}
	h.got = plan.Heal{}
	if _, err := c.(mounter.Healer).HealFuse(ctx, plan.Heal{Dead: []uint64{0}, Source: "/x"}); !errors.Is(err, errdefs.ErrInvalidArgument) || h.got.Source != "" {
		t.Errorf("connection 0: %v (the executor got %+v)", err, h.got)
	}
	h.err = fmt.Errorf("source: %w", errdefs.ErrPermissionDenied)
	if _, err := c.(mounter.Healer).HealFuse(ctx, req); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("refused: %v", err)
	}
	plain, _ := serve(t, &recorder{})
	if _, err := plain.(mounter.Healer).HealFuse(ctx, req); !errors.Is(err, errdefs.ErrUnimplemented) {
		t.Errorf("a mounter that cannot heal: %v, want Unimplemented", err)
	}
}
