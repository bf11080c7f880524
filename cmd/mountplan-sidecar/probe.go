package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/flagalias"
	"github.com/mountplan/mountplan/internal/mounter/service"
)

// runProbe asks the mounter serving at --mounter-endpoint for an answer (its
// client's Ping: a call that looks at nothing) and says in one line whether
// it came: kubelet's liveness probe of the mounter's container runs it, so
// that a serve that lives but no longer answers is restarted. The error
// (exit status 1) says which socket and why, for the pod's events.
// With --plugin-endpoint instead it asks the plugin's CSI socket (the
// chart's `helm test`): its name must be --driver-name and its Probe ready,
// which the plugin is only once its startup reconcile is done and its own
// mounter answers.
func runProbe(ctx context.Context, args []string, out io.Writer) error {
	fs := newFlagSet("probe")
	ep := fs.String("mounter-endpoint", "", "the mounter's socket, as serve's --endpoint, unix:///path (this or --plugin-endpoint)")
	// --endpoint names the socket a process serves (the plugin's, serve's);
	// probe serves none.
	flagalias.Deprecated(fs, "endpoint", "mounter-endpoint", warnDeprecated)
	pluginEP := fs.String("plugin-endpoint", "", "the plugin's CSI socket, unix:///path: ask the plugin (GetPluginInfo, Probe) instead of the mounter")
	driverName := fs.String("driver-name", "", "with --plugin-endpoint: the driver name the plugin must report (empty: any)")
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for the answer: keep it below the probe's timeoutSeconds, so that a silent mounter fails with this reason rather than a kill")
	if err := parse(fs, args); err != nil {
		return err
	}
	if (*ep == "") == (*pluginEP == "") {
		return fmt.Errorf("give one of --mounter-endpoint (the mounter's socket) and --plugin-endpoint (the plugin's): %w", errUsage)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if *pluginEP != "" {
		return probePlugin(ctx, *pluginEP, *driverName, out)
	}
	path, err := endpoint.Path(*ep)
	if err != nil {
		return fmt.Errorf("--mounter-endpoint: %w: %w", err, errUsage)
	}
	c := service.NewClient(path)
	defer c.Close()
	start := time.Now()
	if err := c.Ping(ctx); err != nil {
		// Unavailable whatever the cause (a timeout too): the caller's
		// question is only whether it answers.
		return fmt.Errorf("the mounter at %s does not answer (after %v): %v: %w", path, time.Since(start).Round(time.Millisecond), err, errdefs.ErrUnavailable)
	}
	fmt.Fprintf(out, "the mounter at %s answered in %v\n", path, time.Since(start).Round(time.Microsecond))
	return nil
}

// probePlugin asks the plugin at ep for its name and readiness.
func probePlugin(ctx context.Context, ep, driverName string, out io.Writer) error {
	if _, err := endpoint.Path(ep); err != nil {
		return fmt.Errorf("--plugin-endpoint: %w: %w", err, errUsage)
	}
	conn, err := endpoint.Dial(ep)
	if err != nil {
		return err
	}
	defer conn.Close()
	id := csi.NewIdentityClient(conn)
	info, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil {
		return fmt.Errorf("the plugin at %s does not answer GetPluginInfo (is its pod running on this node?): %v: %w", ep, err, errdefs.ErrUnavailable)
	}
	if driverName != "" && info.GetName() != driverName {
		return fmt.Errorf("the plugin at %s is driver %q, not %q (check driverName in the chart's values): %w", ep, info.GetName(), driverName, errdefs.ErrFailedPrecondition)
	}
	p, err := id.Probe(ctx, &csi.ProbeRequest{})
	if err != nil {
		return fmt.Errorf("the plugin %s at %s fails Probe: %v: %w", info.GetName(), ep, err, errdefs.ErrUnavailable)
	}
	if p.GetReady() != nil && !p.GetReady().GetValue() {
		return fmt.Errorf("the plugin %s at %s is not ready (its startup reconcile is running, or its mounter does not answer: see the mounter pod's log): %w", info.GetName(), ep, errdefs.ErrUnavailable)
	}
	fmt.Fprintf(out, "the plugin %s %s at %s is ready\n", info.GetName(), info.GetVendorVersion(), ep)
	return nil
}
