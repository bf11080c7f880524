package registration

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestNewRefusesBadOptions(t *testing.T) {
	good := Options{DriverName: "d", Socket: "/r/d-reg.sock", CSIEndpoint: "/k/plugins/d/csi.sock"}
	for name, mutate := range map[string]func(*Options){
		"no driver":         func(o *Options) { o.DriverName = "" },
		"relative socket":   func(o *Options) { o.Socket = "r/d-reg.sock" },
		"unclean socket":    func(o *Options) { o.Socket = "/r/../d-reg.sock" },
		"relative endpoint": func(o *Options) { o.CSIEndpoint = "csi.sock" },
	} {
		t.Run(name, func(t *testing.T) {
			o := good
			mutate(&o)
			if _, err := New(o); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("New(%+v) = %v, want InvalidArgument", o, err)
			}
		})
	}
	if _, err := New(good); err != nil {
		t.Fatal(err)
	}
}

// kubelet plays kubelet's plugin watcher against the registration socket.
func kubelet(t *testing.T, sock string) registerapi.RegistrationClient {
	t.Helper()
	conn, err := endpoint.Dial("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return registerapi.NewRegistrationClient(conn)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// start serves opts until the returned stop (or the test's end) and stop
// returns what Serve returned.
func start(t *testing.T, opts Options) (*Server, func() error) {
	t.Helper()
	s, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	stop := sync.OnceValue(func() error { cancel(); return <-done })
	t.Cleanup(func() { _ = stop() })
	waitFor(t, "the registration socket", func() bool { return s.Check(ctx) == nil })
	return s, stop
}

func TestRegistration(t *testing.T) {
	dir := t.TempDir()
	opts := Options{DriverName: "mountplan.csi.io", Socket: filepath.Join(dir, "mountplan.csi.io-reg.sock"),
		CSIEndpoint: "/var/lib/kubelet/plugins/mountplan.csi.io/csi.sock"}
	s, stop := start(t, opts)
	ctx := context.Background()
	k := kubelet(t, opts.Socket)

	info, err := k.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != opts.DriverName || info.Endpoint != opts.CSIEndpoint ||
		len(info.SupportedVersions) == 0 {
		t.Fatalf("GetInfo = %+v", info)
	}
	if registered(s) {
		t.Fatal("registered before kubelet said so")
	}
	if err := s.Check(ctx); err != nil {
		t.Fatalf("waiting for kubelet must be healthy: %v", err)
	}

	// kubelet refuses: unhealthy, with kubelet's reason.
	if _, err := k.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: "driver name taken"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(ctx); err == nil || registered(s) {
		t.Fatalf("after a refusal: Check = %v, Registered = %v", err, registered(s))
	}
	// kubelet accepts (a later attempt).
	if _, err := k.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(ctx); err != nil || !registered(s) {
		t.Fatalf("after registration: Check = %v, Registered = %v", err, registered(s))
	}

	// Someone removes the socket: kubelet forgot the plugin; unhealthy.
	if err := os.Remove(opts.Socket); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(ctx); !errors.Is(err, ErrSocketGone) {
		t.Fatalf("Check with the registration socket removed = %v, want ErrSocketGone", err)
	}
	if err := stop(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// A socket that replaced the registration socket is another process's:
// Check says the registration is gone, and stopping leaves that socket.
func TestReplacedSocketIsNotOurs(t *testing.T) {
	dir := t.TempDir()
	opts := Options{DriverName: "d", Socket: filepath.Join(dir, "d-reg.sock"), CSIEndpoint: "/k/csi.sock"}
	s, stop := start(t, opts)
	if err := os.Remove(opts.Socket); err != nil {
		t.Fatal(err)
	}
	other, err := net.Listen("unix", opts.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := s.Check(context.Background()); !errors.Is(err, ErrSocketGone) {
		t.Fatalf("Check with the socket replaced = %v, want ErrSocketGone", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(opts.Socket); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("the replacing socket after stop: %v %v", fi, err)
	}
}

// Stopping removes the socket (deregistration); a stale socket of an
// earlier, killed process is replaced at start.
func TestSocketLifecycle(t *testing.T) {
	dir := t.TempDir()
	opts := Options{DriverName: "d", Socket: filepath.Join(dir, "d-reg.sock"), CSIEndpoint: "/k/csi.sock"}
	_, stop := start(t, opts)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(opts.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after stop: %v", err)
	}

	// A stale socket: its process was killed and never unlinked it.
	l, err := net.Listen("unix", opts.Socket)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	_, stop = start(t, opts)
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	// Anything else there is not ours to remove.
	if err := os.WriteFile(opts.Socket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Serve(context.Background()); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Serve over a regular file = %v, want FailedPrecondition", err)
	}
}

// registered says whether kubelet confirmed s's registration.
func registered(s *Server) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status == nil
}
