package mounter

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// Serve serves m as the Mounter service on l until ctx is done, then lets
// calls in flight finish. Closing l removes its socket.
func Serve(ctx context.Context, l net.Listener, m Interface, opts ...ServerOption) error {
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(LogInterceptor(klog.FromContext(ctx))))
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
