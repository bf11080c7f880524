package driver

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
)

var requestSeq atomic.Uint64

type volumeIDGetter interface{ GetVolumeId() string }

// Interceptor is the one place where errors become gRPC codes. It also puts
// a contextual logger (method, request number, volume) into the context,
// logs requests with their secrets stripped by protosanitizer, turns a
// panic into an Internal error instead of a dead plugin, and records the
// call's latency by method and code.
func (d *Driver) Interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	start := time.Now()
	defer func() { d.opts.Metrics.ObserveRPC(info.FullMethod, status.Code(err), time.Since(start)) }()
	logger := klog.FromContext(ctx).WithValues("method", info.FullMethod, "request", requestSeq.Add(1))
	if r, ok := req.(volumeIDGetter); ok && r.GetVolumeId() != "" {
		logger = logger.WithValues("volume", r.GetVolumeId())
	}
	ctx = klog.NewContext(ctx, logger)
	logger.V(4).Info("Request", "body", protosanitizer.StripSecrets(req))
	defer func() {
		if r := recover(); r != nil {
			logger.Error(nil, "Panic in handler", "panic", r, "stack", string(debug.Stack()))
			err = status.Error(codes.Internal, fmt.Sprintf("internal error in %s", info.FullMethod))
		}
	}()
	resp, err = handler(ctx, req)
	if err != nil {
		err = errdefs.ToGRPC(err)
		logger.V(2).Info("Failed", "code", status.Code(err), "err", err)
		return resp, err
	}
	logger.V(4).Info("Done", "response", protosanitizer.StripSecrets(resp))
	return resp, nil
}
