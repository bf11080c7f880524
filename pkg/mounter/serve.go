package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/errdefs"
)

// socketPath returns the path of a unix:///abs/path endpoint.
func socketPath(endpoint string) (string, error) {
	p, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return "", fmt.Errorf("endpoint %q must be unix:///absolute/path: %w", endpoint, errdefs.ErrInvalidArgument)
	}
	return p, nil
}

// Dial connects to a gRPC service on a unix:///path endpoint. The connection
// is made lazily, on the first call.
func Dial(endpoint string) (*grpc.ClientConn, error) {
	if _, err := socketPath(endpoint); err != nil {
		return nil, err
	}
	return grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// ListenUnix listens on a unix:///path endpoint, readable and writable by
// its owner only: whoever can connect can mount. A socket left by a previous
// run is removed; a socket something still serves on, or any other file, is
// not.
func ListenUnix(endpoint string) (net.Listener, error) {
	p, err := socketPath(endpoint)
	if err != nil {
		return nil, err
	}
	if err := removeStaleSocket(p); err != nil {
		return nil, err
	}
	l, err := net.Listen("unix", p)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(p, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

func removeStaleSocket(p string) error {
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket: %w", p, errdefs.ErrFailedPrecondition)
	}
	if c, err := net.DialTimeout("unix", p, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("%s: another process is serving on it: %w", p, errdefs.ErrAlreadyExists)
	}
	return os.Remove(p)
}

// Serve serves m as the Mounter service on l until ctx is done, then lets
// calls in flight finish. Closing l removes its socket.
func Serve(ctx context.Context, l net.Listener, m Interface) error {
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(LogInterceptor(klog.FromContext(ctx))))
	api.RegisterMounterServer(srv, NewServer(m))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		srv.GracefulStop()
		return <-errc
	}
}

// LogInterceptor gives every call a logger that names its method (reach it
// with klog.FromContext) and logs how the call ended. It logs no request or
// response: a plan's options may hold secrets.
func LogInterceptor(logger klog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		l := klog.LoggerWithValues(logger, "method", info.FullMethod)
		resp, err := handler(klog.NewContext(ctx, l), req)
		if err != nil {
			l.Error(err, "Call failed", "code", status.Code(err))
		} else {
			l.V(4).Info("Call succeeded")
		}
		return resp, err
	}
}
