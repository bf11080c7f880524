// Package health serves /healthz for kubelet's liveness probe of the
// plugin's container, as the livenessprobe sidecar would: the plugin's CSI
// Probe through its own socket (which proves the socket exists and the gRPC
// server answers), plus any other check (built-in kubelet registration).
package health

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"
)

// Check fails with a reason when the container is unhealthy.
type Check func(ctx context.Context) error

// ProbeCSI calls Identity.Probe on conn: an error, or ready=false, fails.
func ProbeCSI(conn grpc.ClientConnInterface) Check {
	client := csi.NewIdentityClient(conn)
	return func(ctx context.Context) error {
		resp, err := client.Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			return fmt.Errorf("CSI probe: %w", err)
		}
		// CSI: an absent ready field means ready.
		if r := resp.GetReady(); r != nil && !r.GetValue() {
			return errors.New("CSI probe: driver not ready")
		}
		return nil
	}
}

// Handler answers GET /healthz with 200 when every check passes within
// timeout, else 500 with the first failure.
func Handler(timeout time.Duration, checks ...Check) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), timeout)
		defer cancel()
		for _, c := range checks {
			if err := c(ctx); err != nil {
				klog.FromContext(ctx).V(2).Info("Health check failed", "err", err)
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
