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
	"github.com/mountplan/mountplan/internal/registration"
)

// errKubelet marks a failure of what kubelet talks to besides the CSI socket.
var errKubelet = errors.New("kubelet endpoint")

// kubeletFlags: what the node-driver-registrar and livenessprobe sidecars
// would otherwise do, for clusters that cannot run them.
type kubeletFlags struct {
	registrationSocket, registrationPath, healthAddress string
}

func (k *kubeletFlags) define() {
	flag.StringVar(&k.registrationSocket, "registration-socket", "", "register with kubelet by serving its plugin registration API on this socket, in kubelet's plugins_registry directory (e.g. /registration/mountplan.csi.io-reg.sock); empty: a node-driver-registrar does it")
	flag.StringVar(&k.registrationPath, "kubelet-registration-path", "", "with --registration-socket: the CSI socket's path on the host, as kubelet dials it (e.g. /var/lib/kubelet/plugins/mountplan.csi.io/csi.sock)")
	flag.StringVar(&k.healthAddress, "health-address", "", "serve GET /healthz for kubelet's liveness probe on this address (host:port): the CSI Probe through the socket, and the registration; empty: off")
}

func (k *kubeletFlags) check() error {
	if (k.registrationSocket == "") != (k.registrationPath == "") {
		return fmt.Errorf("--registration-socket and --kubelet-registration-path go together")
	}
	return nil
}

// serve starts built-in registration and the health endpoint, as the flags
// ask. Call it once the CSI socket listens: kubelet dials it while
// registering. fail stops the plugin with the cause.
func (k *kubeletFlags) serve(ctx context.Context, f flags, fail context.CancelCauseFunc) error {
	var checks []health.Check
	if k.registrationSocket != "" {
		reg, err := registration.New(registration.Options{DriverName: f.driverName,
			Socket: k.registrationSocket, CSIEndpoint: k.registrationPath})
		if err != nil {
			return err
		}
		checks = append(checks, reg.Check)
		go func() {
			if err := reg.Serve(ctx); err != nil {
				fail(fmt.Errorf("%w: %w", errKubelet, err))
			}
		}()
	}
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
	h := health.Handler(3*time.Second, append([]health.Check{health.ProbeCSI(conn)}, checks...)...)
	go func() {
		defer conn.Close()
		if err := endpoint.ServeHTTP(ctx, lis, h); err != nil {
			klog.ErrorS(err, "Health endpoint failed", "address", k.healthAddress)
			fail(fmt.Errorf("%w: health: %w", errKubelet, err))
		}
	}()
	return nil
}
