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
	"github.com/mountplan/mountplan/internal/registration"
)

// registrationFlags configure serve's registration of the plugin with
// kubelet (the chart's registration: builtin). The mounter serves it, not
// the plugin, so that the plugin's container need not write kubelet's
// plugins_registry, where a socket may claim any driver's name (issue 33,
// F5). Nothing it tells kubelet comes from the plugin: the driver's name
// and the CSI socket's path are these flags.
type registrationFlags struct {
	socket, csiPath, driverName string
}

// Pauses of the registration's supervision; variables for the tests.
var (
	// registrationCheckInterval: how often the registration socket is
	// checked, and re-made when someone removed it.
	registrationCheckInterval = 5 * time.Second
	// pluginPollInterval: how often the plugin's CSI socket is tried
	// before the first registration, and how long to wait before serving
	// again after the registration socket could not be made.
	pluginPollInterval = time.Second
)

func addRegistrationFlags(fs *flag.FlagSet) *registrationFlags {
	f := &registrationFlags{}
	fs.StringVar(&f.socket, "registration-socket", "",
		"register the plugin with kubelet by serving kubelet's plugin registration API on this socket, in kubelet's plugins_registry directory "+
			"(e.g. /registration/mountplan.csi.io-reg.sock), once the plugin's socket (--plugin-endpoint) accepts a connection; empty: off")
	fs.StringVar(&f.csiPath, "kubelet-registration-path", "",
		"with --registration-socket: the plugin's CSI socket on the host, as kubelet dials it (e.g. /var/lib/kubelet/plugins/mountplan.csi.io/csi.sock)")
	fs.StringVar(&f.driverName, "driver-name", "", "with --registration-socket: the CSI driver's name, as the plugin's --driver-name")
	return f
}

// options checks the flags: all three together, with the plugin's endpoint
// to wait for. ok is false when registration is off.
func (f *registrationFlags) options(pluginEndpoint string) (opts registration.Options, pluginSocket string, ok bool, err error) {
	if f.socket == "" && f.csiPath == "" && f.driverName == "" {
		return opts, "", false, nil
	}
	if f.socket == "" || f.csiPath == "" || f.driverName == "" || pluginEndpoint == "" {
		return opts, "", false, fmt.Errorf("--registration-socket, --kubelet-registration-path, --driver-name and --plugin-endpoint go together: %w", errUsage)
	}
	opts = registration.Options{DriverName: f.driverName, Socket: f.socket, CSIEndpoint: f.csiPath}
	if _, err := registration.New(opts); err != nil {
		return opts, "", false, fmt.Errorf("%w: %w", err, errUsage)
	}
	if pluginSocket, err = endpoint.Path(pluginEndpoint); err != nil {
		return opts, "", false, fmt.Errorf("--plugin-endpoint: %w: %w", err, errUsage)
	}
	return opts, pluginSocket, true, nil
}

// start registers the plugin with kubelet until ctx ends or stop is
// called, when --registration-socket is set: once the plugin's socket
// accepts a connection (kubelet dials it while registering, and would
// otherwise retry only on its own backoff, up to two minutes), and again
// whenever the registration socket is removed or replaced. stop returns
// once the registration socket is removed, which deregisters the plugin.
func (f *registrationFlags) start(ctx context.Context, pluginEndpoint string) (stop func(), err error) {
	opts, pluginSocket, ok, err := f.options(pluginEndpoint)
	if err != nil || !ok {
		return func() {}, err
	}
	logger := klog.FromContext(ctx).WithName("registration")
	ctx, cancel := context.WithCancel(klog.NewContext(ctx, logger))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if waitForPlugin(ctx, pluginSocket) != nil {
			return
		}
		for ctx.Err() == nil {
			serveRegistration(ctx, opts)
		}
	}()
	return func() { cancel(); <-done }, nil
}

// waitForPlugin returns once the plugin's CSI socket accepts a connection,
// or with ctx's error. It connects and closes, and reads nothing: the
// plugin writes that directory and may have put anything there.
func waitForPlugin(ctx context.Context, socket string) error {
	logger := klog.FromContext(ctx)
	logger.Info("Waiting for the plugin's socket before registering with kubelet", "pluginSocket", socket)
	var d net.Dialer
	for {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := d.DialContext(dctx, "unix", socket)
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		logger.V(4).Info("The plugin's socket does not accept a connection yet", "pluginSocket", socket, "err", err)
		if pause(ctx, pluginPollInterval) != nil {
			return ctx.Err()
		}
	}
}

// serveRegistration serves the registration socket until ctx ends or the
// socket is removed or replaced, then stops, removing it if it is still
// its own. A socket that could not be made (another process serves one
// there) is tried again after a pause.
func serveRegistration(ctx context.Context, opts registration.Options) {
	logger := klog.FromContext(ctx)
	reg, err := registration.New(opts)
	if err != nil { // options checked at start
		logger.Error(err, "Registration")
		return
	}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- reg.Serve(sctx) }()
	tick := time.NewTicker(registrationCheckInterval)
	defer tick.Stop()
	for {
		select {
		case err := <-served:
			if err != nil {
				logger.Error(err, "Cannot serve the registration socket; trying again", "socket", opts.Socket, "in", pluginPollInterval)
				_ = pause(ctx, pluginPollInterval)
			}
			return
		case <-tick.C:
			if err := reg.Check(ctx); errors.Is(err, registration.ErrSocketGone) {
				logger.Info("The registration socket was removed or replaced: registering again", "socket", opts.Socket)
				stop()
				<-served
				return
			}
		}
	}
}

// pause waits d, or until ctx ends: then it returns ctx's error.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
