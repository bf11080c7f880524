package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nri"
)

// nriFlags configure serve's NRI hook.
type nriFlags struct {
	enabled        bool
	socket         string
	pluginEndpoint string
	timeout        time.Duration
}

func addNRIFlags(fs *flag.FlagSet) *nriFlags {
	f := &nriFlags{}
	fs.BoolVar(&f.enabled, "nri", false, "register with the container runtime as an NRI plugin, which gives containers the volumes published in NRI mode")
	fs.StringVar(&f.socket, "nri-socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
	fs.StringVar(&f.pluginEndpoint, "plugin-endpoint", "", "the plugin's CSI socket, unix:///path (required with --nri or --registration-socket); when set, the mounter serves only callers in the mount namespace of the process that listens on it")
	fs.DurationVar(&f.timeout, "nri-timeout", 0,
		"how long the hook may work on a container's creation or start before it fails it; 0: three quarters of the runtime's plugin request timeout "+
			"(containerd's plugin_request_timeout, 2s by default), as the runtime says at registration. Keep it below the runtime's, "+
			"after which the runtime would start the container without the volume and drop the hook")
	return f
}

// start runs the hook until ctx ends, when --nri is set.
// kubeletDir is where targets bound to a dead guard are re-armed.
// stateDir is where the guard lives.
func (f *nriFlags) start(ctx context.Context, m mounter.Interface, stateDir, kubeletDir string) (wait func(), err error) {
	if !f.enabled {
		return func() {}, nil
	}
	if f.pluginEndpoint == "" {
		return nil, fmt.Errorf("--plugin-endpoint is required with --nri: %w", errUsage)
	}
	np, closeConn, err := dialPlugin(f.pluginEndpoint)
	if err != nil {
		return nil, err
	}
	h := nri.NewHook(nri.PluginVolumes{Client: np}, m, stateDir, kubeletDir)
	h.Timeout = f.timeout
	logger := klog.FromContext(ctx).WithName("nri")
	logger.Info("Registering with the container runtime", "nriSocket", f.socket, "stateDir", stateDir, "kubeletDir", kubeletDir)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer closeConn()
		_ = nri.Run(klog.NewContext(ctx, logger), f.socket, h)
	}()
	return func() { <-done }, nil
}
