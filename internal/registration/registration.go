// Package registration registers the plugin with kubelet, as
// node-driver-registrar would from a container of its own: kubelet's plugin
// watcher finds a unix socket in <kubelet-dir>/plugins_registry/, asks it
// (GetInfo) for the driver's name and the path of its CSI socket, dials that
// socket, and tells the registration socket (NotifyRegistrationStatus)
// whether it took the plugin. Removing the socket deregisters the plugin.
//
// The mounter serves it (mountplan-sidecar serve --registration-socket),
// not the plugin: whoever writes plugins_registry can claim any driver's
// name and have kubelet send that driver's calls, with their secrets, to a
// socket of its choosing (docs/threat-model.md). Everything it answers
// comes from its Options, never from the plugin.
package registration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/errdefs"
)

// csiVersions are the CSI versions kubelet may speak to the plugin.
var csiVersions = []string{"1.0.0"}

// ErrNotRegistered says kubelet has not (yet) confirmed the registration.
var ErrNotRegistered = errors.New("kubelet has not confirmed the plugin's registration")

// ErrSocketGone says the registration socket was removed or replaced:
// kubelet no longer knows the plugin through it, and serving again (a new
// socket) registers it again. A refusal by kubelet is not this: kubelet
// retries a socket it refused by itself.
var ErrSocketGone = errors.New("registration socket removed or replaced")

// Options says what to register and where.
type Options struct {
	// DriverName is the CSI driver's name.
	DriverName string
	// Socket is the registration socket's path as this process sees it, in
	// kubelet's plugins_registry directory (mounted from the host).
	Socket string
	// CSIEndpoint is the path of the plugin's CSI socket as kubelet sees it
	// on the host (<kubelet-dir>/plugins/<driver>/csi.sock).
	CSIEndpoint string
}

// Server serves kubelet's Registration service and remembers kubelet's answer.
type Server struct {
	registerapi.UnimplementedRegistrationServer
	opts Options

	mu     sync.Mutex
	status error       // kubelet's answer: nil registered, ErrNotRegistered before it answered
	sock   os.FileInfo // the socket created, to notice when it is removed or replaced
}

// New checks the options; nothing is created before Serve.
func New(opts Options) (*Server, error) {
	switch {
	case opts.DriverName == "":
		return nil, fmt.Errorf("registration: no driver name: %w", errdefs.ErrInvalidArgument)
	case !filepath.IsAbs(opts.Socket) || filepath.Clean(opts.Socket) != opts.Socket:
		return nil, fmt.Errorf("registration socket %q must be an absolute clean path: %w", opts.Socket, errdefs.ErrInvalidArgument)
	case !filepath.IsAbs(opts.CSIEndpoint) || filepath.Clean(opts.CSIEndpoint) != opts.CSIEndpoint:
		return nil, fmt.Errorf("kubelet registration path %q must be an absolute clean path: %w", opts.CSIEndpoint, errdefs.ErrInvalidArgument)
	}
	return &Server{opts: opts, status: ErrNotRegistered}, nil
}

// Serve creates the registration socket (kubelet notices it at once, or when
// it starts) and serves on it until ctx ends, then removes it, which
// deregisters the plugin: the socket it made, not one that replaced it.
// Call it once the CSI socket serves: kubelet dials that socket while
// registering.
func (s *Server) Serve(ctx context.Context) error {
	lis, err := endpoint.Listen("unix://" + s.opts.Socket)
	if err != nil {
		return fmt.Errorf("registration socket: %w", err)
	}
	fi, err := os.Lstat(s.opts.Socket)
	if err != nil {
		lis.Close()
		return err
	}
	// Closing a listener unlinks its path, whatever is there by then.
	if ul, ok := lis.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	defer s.removeOwn(fi)
	s.mu.Lock()
	s.sock = fi
	s.mu.Unlock()
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, s)
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	klog.InfoS("Waiting for kubelet to register the plugin", "socket", s.opts.Socket, "csiEndpoint", s.opts.CSIEndpoint)
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) && !errors.Is(err, net.ErrClosed) {
		return err
	}
	return nil
}

// removeOwn removes the registration socket if it is still the one Serve
// created (fi): a socket that replaced it is another process's.
func (s *Server) removeOwn(fi os.FileInfo) {
	if now, err := os.Lstat(s.opts.Socket); err == nil && os.SameFile(now, fi) {
		if err := os.Remove(s.opts.Socket); err != nil {
			klog.ErrorS(err, "Cannot remove the registration socket", "socket", s.opts.Socket)
		}
	}
}

// GetInfo answers kubelet's plugin watcher.
func (s *Server) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.opts.DriverName,
		Endpoint:          s.opts.CSIEndpoint,
		SupportedVersions: csiVersions,
	}, nil
}

// NotifyRegistrationStatus records kubelet's answer.
func (s *Server) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st.PluginRegistered {
		s.status = nil
		klog.InfoS("kubelet registered the plugin", "driver", s.opts.DriverName)
	} else {
		s.status = fmt.Errorf("kubelet refused the plugin's registration: %s", st.Error)
		klog.ErrorS(s.status, "Registration failed", "driver", s.opts.DriverName)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// Check says whether the registration stands: an error when kubelet
// refused the plugin, or ErrSocketGone when the registration socket is gone
// or replaced (kubelet then no longer knows the plugin; serving again
// registers it again). Waiting for kubelet's first answer is no failure:
// kubelet may be starting.
func (s *Server) Check(context.Context) error {
	s.mu.Lock()
	status, sock := s.status, s.sock
	s.mu.Unlock()
	if sock == nil {
		return fmt.Errorf("registration socket %s not created yet", s.opts.Socket)
	}
	fi, err := os.Lstat(s.opts.Socket)
	if err != nil || !os.SameFile(fi, sock) {
		return fmt.Errorf("%s: %w", s.opts.Socket, ErrSocketGone)
	}
	if errors.Is(status, ErrNotRegistered) {
		return nil
	}
	return status
}
