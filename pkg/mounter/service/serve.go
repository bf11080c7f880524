package service

import (
	"context"
	"net"
	"runtime/debug"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mounter"
)

// Serve serves m as the Mounter service on l until ctx is done, then lets
// calls in flight finish. Closing l removes its socket.
func Serve(ctx context.Context, l net.Listener, m mounter.Interface, opts ...ServerOption) error {
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(Interceptor(klog.FromContext(ctx))))
	api.RegisterMounterServer(srv, NewServer(m, opts...))
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

// Interceptor is the one place where the Mounter service's errors become
// status codes (errdefs.ToGRPC). It gives every call a logger that names
// its method (reach it with klog.FromContext), logs how the call ended, and
// turns a panic into Internal instead of a dead mounter. It logs no request
// or response: a plan's options may hold secrets.
func Interceptor(logger klog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		l := klog.LoggerWithValues(logger, "method", info.FullMethod)
		defer func() {
			if r := recover(); r != nil {
				l.Error(nil, "Panic in handler", "panic", r, "stack", string(debug.Stack()))
				resp, err = nil, status.Errorf(codes.Internal, "internal error in %s", info.FullMethod)
			}
		}()
		resp, err = handler(klog.NewContext(ctx, l), req)
		if err != nil {
			err = errdefs.ToGRPC(err)
			l.Error(err, "Call failed", "code", status.Code(err))
			return nil, err
		}
		l.V(4).Info("Call succeeded")
		return resp, nil
	}
}
