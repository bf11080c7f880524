package health

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mountplan/mountplan/internal/endpoint"
)

type identity struct {
	csi.UnimplementedIdentityServer
	resp *csi.ProbeResponse
	err  error
	slow time.Duration
}

func (i *identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	select {
	case <-time.After(i.slow):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return i.resp, i.err
}

func serveIdentity(t *testing.T, id *identity) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, id)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := endpoint.Dial("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestHandler(t *testing.T) {
	failing := func(context.Context) error { return errors.New("registration refused") }
	for _, tc := range []struct {
		name   string
		id     identity
		extra  []Check
		status int
	}{
		{name: "ready", id: identity{resp: &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}}, status: 200},
		{name: "ready unset means ready", id: identity{resp: &csi.ProbeResponse{}}, status: 200},
		{name: "not ready", id: identity{resp: &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}}, status: 500},
		{name: "probe error", id: identity{err: status.Error(codes.Internal, "journal not writable")}, status: 500},
		{name: "probe hangs", id: identity{resp: &csi.ProbeResponse{}, slow: time.Minute}, status: 500},
		{name: "other check fails", id: identity{resp: &csi.ProbeResponse{}}, extra: []Check{failing}, status: 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn := serveIdentity(t, &tc.id)
			h := Handler(200*time.Millisecond, append([]Check{ProbeCSI(conn)}, tc.extra...)...)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
			if rec.Code != tc.status {
				t.Fatalf("GET /healthz = %d %q, want %d", rec.Code, rec.Body.String(), tc.status)
			}
		})
	}
}

// The socket gone (nobody serves it): unhealthy, not a hang.
func TestHandlerNoSocket(t *testing.T) {
	conn, err := endpoint.Dial("unix://" + filepath.Join(t.TempDir(), "gone.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rec := httptest.NewRecorder()
	Handler(time.Second, ProbeCSI(conn)).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if rec.Code != http.StatusInternalServerError {
		t.Fatalf("GET /healthz = %d, want 500", rec.Code)
	}
}
