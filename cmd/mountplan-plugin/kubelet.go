package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/health"
)

// errKubelet marks a failure of what kubelet talks to besides the CSI socket
// (the health endpoint).
var errKubelet = errors.New("kubelet endpoint")

// kubeletFlags: what the livenessprobe sidecar would otherwise do, for
// clusters that cannot run it. Registration with kubelet is not the
// plugin's: the mounter (mountplan-sidecar serve --registration-socket) or
// node-driver-registrar writes kubelet's plugins_registry, which the
// plugin's container does not mount (issue 33, F5).
type kubeletFlags struct {
	healthAddress string
}

func (k *kubeletFlags) define() {
	flag.StringVar(&k.healthAddress, "health-address", "", "serve GET /healthz for kubelet's liveness probe on this address (host:port): the CSI Probe through the plugin's own socket; empty: off")
}

// serve starts the health endpoint, as the flags ask. Call it once the CSI
// socket listens. fail stops the plugin with the cause.
func (k *kubeletFlags) serve(ctx context.Context, f flags, fail context.CancelCauseFunc) error {
	if k.healthAddress == "" {
		return nil
	}
	conn, err := endpoint.Dial(f.endpoint)
	if err != nil {
		return err
	}
	// Listen here: a bad address must stop the plugin, not be a log line.
	lis, err := net.Listen("tcp", k.healthAddress)
	if err != nil {
		conn.Close()
		return fmt.Errorf("--health-address: %w", err)
	}
	h := health.Handler(3*time.Second, health.ProbeCSI(conn))
	go func() {
		defer conn.Close()
		if err := endpoint.ServeHTTP(ctx, lis, h); err != nil {
			klog.ErrorS(err, "Health endpoint failed", "address", k.healthAddress)
			fail(fmt.Errorf("%w: health: %w", errKubelet, err))
		}
	}()
	return nil
}
