// Command mountplan-plugin serves the CSI Identity, Controller and Node
// services and the NodePrepare extension on one unix socket.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/driver"
	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/fdlimit"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/internal/preflight"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/fuse"
	"github.com/mountplan/mountplan/internal/source/iscsi"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/source/nbd"
	"github.com/mountplan/mountplan/internal/toolrun"
	"github.com/mountplan/mountplan/internal/version"
	"github.com/mountplan/mountplan/internal/volview"
)

// maxRequest bounds one request to the plugin's socket.
const maxRequest = 4 << 20

// streamWorkers is how many goroutines serve gRPC calls: kubelet's calls
// for one node come a few at a time.
const streamWorkers = 4

type flags struct {
	endpoint, nodeID, stateDir, kubeletDir, driverName, configPath, mounterEndpoint, metricsAddress string
	bootIDFile                                                                                      string
	reconcileInterval, rebootGrace                                                                  time.Duration
	fuseProbeInterval, fuseProbeTimeout                                                             time.Duration
	kubelet                                                                                         kubeletFlags
	nri                                                                                             bool
}

func main() {
	toolrun.ServeSpawnerIfAsked() // this process may be the plugin's tool spawner
	daemon.ServeSandboxIfAsked()  // or the sandbox of a daemon in fd mode (a mounter of its own)
	var f flags
	flag.StringVar(&f.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint (unix:///abs/path.sock)")
	flag.StringVar(&f.nodeID, "node-id", "", "name of this node (required)")
	flag.StringVar(&f.stateDir, "state-dir", config.DefaultStateDir, "directory for the journal, images and private mounts")
	flag.StringVar(&f.kubeletDir, "kubelet-dir", config.DefaultKubeletDir, "kubelet's root directory: every staging and target path must lie under it")
	flag.StringVar(&f.driverName, "driver-name", "mountplan.csi.io", "CSI driver name")
	flag.StringVar(&f.configPath, "config", "", "admin policy file (YAML); optional")
	flag.StringVar(&f.mounterEndpoint, "mounter-endpoint", "", "the mounter's socket (mountplan-sidecar serve), which does every privileged act: devices, mounts, FUSE daemons; empty: all of it in this process, which then needs the privileges")
	flag.StringVar(&f.metricsAddress, "metrics-address", "", "serve Prometheus metrics on this address (host:port); empty: off")
	flag.DurationVar(&f.reconcileInterval, "reconcile-interval", time.Minute, "how often records are compared with the kernel")
	flag.DurationVar(&f.rebootGrace, "reboot-grace", driver.DefaultRebootGrace, "after a reboot, how long volumes kubelet does not stage or publish again keep what the reboot erased (their stage and publishes; inline volumes their image)")
	flag.StringVar(&f.bootIDFile, "boot-id-file", journal.BootIDPath, "where the ID of the running boot is read; the plugin compares it with the one its state dir recorded to tell a reboot it did not see (tests point it at a file to play a reboot)")
	flag.DurationVar(&f.fuseProbeInterval, "fuse-probe-interval", 2*time.Second, "how often each FUSE daemon is checked")
	flag.DurationVar(&f.fuseProbeTimeout, "fuse-probe-timeout", 5*time.Second, "a FUSE daemon that leaves a statfs unanswered this long is restarted")
	f.kubelet.define()
	flag.BoolVar(&f.nri, "nri", false, "let volumes with the attribute nri: \"true\" reach containers only through the mounter's NRI hook (mountplan-sidecar serve --nri)")
	showVersion := flag.Bool("version", false, "print the version, git revision, build date and Go version, and exit")
	klog.InitFlags(nil)
	flag.Parse()
	if *showVersion {
		version.Get().Print(os.Stdout, "mountplan-plugin")
		return
	}
	if err := run(f); err != nil {
		klog.ErrorS(err, "mountplan-plugin failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(f flags) error {
	cfg, err := f.check()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background())
	// Without a mounter of its own the plugin mounts and needs what the
	// mounter needs; beside one it only reports the kernel's features.
	found, err := preflight.Start(klog.Background(), preflight.Options{Mounts: f.mounterEndpoint == "",
		Tools: preflight.ProfileTools(cfg.FuseProfiles)})
	if err != nil {
		return err
	}

	node, restarted, closeMounter, err := newMounter(ctx, f, cfg)
	if err != nil {
		return err
	}
	defer closeMounter()
	var d *driver.Driver
	mx := newMetrics(f, func() map[string]int { return d.StagedByType() }, node)
	mx.Preflight(found.Available())
	sources, err := newSources(f, cfg, node, mx)
	if err != nil {
		return err
	}
	d, err = driver.New(driver.Options{DriverName: f.driverName, NodeID: f.nodeID, Version: version.Get().Version,
		StateDir: f.stateDir, KubeletDir: f.kubeletDir, Config: cfg, Node: node, Metrics: mx, NRI: f.nri,
		Sources: sources, DefaultType: loop.Type, RebootGrace: f.rebootGrace, BootID: journal.BootFrom(f.bootIDFile)})
	if err != nil {
		return err
	}
	mx.WatchReboot(d.RebootedFrom() != "", d.AwaitingRestage)
	// A new mounter process cleared the loop devices nothing mounted (unless
	// it could take them back): reconcile at once rather than at the next
	// interval, so that staged volumes get their devices again.
	restarted(func() {
		klog.InfoS("The mounter restarted; reconciling")
		if err := d.Reconcile(ctx); err != nil {
			klog.ErrorS(err, "Reconcile after the mounter's restart left errors")
		}
	})
	debug := map[string]http.Handler{"/debug/volumes": volview.Handler(d.Volumes, volview.HostProc)}
	if err := serveMetrics(ctx, mx, f.metricsAddress, debug); err != nil {
		return err
	}
	lis, err := endpoint.Listen(f.endpoint)
	if err != nil {
		return err
	}
	// CSI requests are small; secrets (certificates, keys) are the
	// largest part. The bound is gRPC's default, said out loud. A few
	// long-lived workers serve the calls instead of a new goroutine per
	// call, whose stack then grows afresh each time (4 % of the plugin's
	// CPU in a publish cycle; the cycle 2-4 % faster, docs/limits.md);
	// when all of them are busy gRPC starts a goroutine as before.
	srv := grpc.NewServer(grpc.UnaryInterceptor(d.Interceptor), grpc.MaxRecvMsgSize(maxRequest), grpc.NumStreamWorkers(streamWorkers))
	d.Register(srv)
	// A failure of what kubelet talks to besides the CSI socket stops the plugin.
	ctx, failKubelet := context.WithCancelCause(ctx)
	defer failKubelet(nil)
	if err := f.kubelet.serve(ctx, f, failKubelet); err != nil {
		return err
	}
	runInBackground(ctx, d, sources, f.reconcileInterval)
	go func() {
		<-ctx.Done()
		klog.InfoS("Stopping")
		srv.GracefulStop()
	}()
	klog.InfoS("Serving", "endpoint", f.endpoint, "driver", f.driverName, "node", f.nodeID, "version", version.Get().Version, "revision", version.Get().Revision)
	if err := srv.Serve(lis); err != nil {
		return err
	}
	if err := context.Cause(ctx); errors.Is(err, errKubelet) {
		return err
	}
	return nil
}

// check checks the flags before anything starts and loads the config
// file they name.
func (f flags) check() (*config.Config, error) {
	if f.nodeID == "" {
		return nil, fmt.Errorf("--node-id is required")
	}
	cfg, err := config.Load(f.configPath)
	if err != nil {
		return nil, err
	}
	return cfg, nil
}

// newMetrics creates the metrics when --metrics-address asks for them (nil
// otherwise): the registry, the node's name (--node-id) for dashboards to
// select nodes by, and the FUSE daemons' usage when the mounter reports it.
// staged is asked for the staged volumes by type at each scrape.
func newMetrics(f flags, staged func() map[string]int, node mounter.Node) *metrics.Metrics {
	if f.metricsAddress == "" {
		return nil
	}
	mx := metrics.New(staged)
	mx.NodeInfo(f.nodeID)
	if u, ok := node.(mounter.DaemonUsages); ok {
		mx.AddDaemonUsage(daemonUsage(u))
	}
	return mx
}

// serveMetrics serves the metrics (and the debug endpoints) on address when
// there are metrics. It listens before it returns, not in the goroutine: a
// bad --metrics-address must stop the plugin, not be a log line nobody reads.
func serveMetrics(ctx context.Context, mx *metrics.Metrics, address string, debug map[string]http.Handler) error {
	if mx == nil {
		return nil
	}
	lis, err := net.Listen("tcp", address)
	if err != nil {
		return fmt.Errorf("--metrics-address: %w", err)
	}
	go func() {
		if err := mx.Serve(ctx, lis, debug); err != nil {
			klog.ErrorS(err, "Metrics server failed", "address", address)
		}
	}()
	return nil
}

// runInBackground starts what runs beside the CSI server until ctx ends:
// the sources' own loops and the reconciler, whose first pass runs at once
// while the server already answers (Probe says "not ready" meanwhile).
func runInBackground(ctx context.Context, d *driver.Driver, sources map[string]source.Source, interval time.Duration) {
	for _, s := range sources {
		if r, ok := s.(source.Runner); ok {
			go r.Run(ctx, interval) // FUSE orphans; daemons outlive the plugin
		}
	}
	go func() {
		if err := d.Reconcile(ctx); err != nil {
			klog.ErrorS(err, "Startup reconcile left errors")
			// Tried again soon rather than one whole interval later: what
			// it could not do (thaw the source a crashed copy left frozen,
			// adopt a device) may block a consumer until it is done.
			periodic.Retry(ctx, time.Second, interval/2, d.Reconcile)
		}
		klog.InfoS("Startup reconcile finished")
		d.RunReconciler(ctx, interval)
	}()
}

// newSources builds every kind of volume the plugin serves, by type, over
// the mounter: loop (the default type), fuse, nbd and iscsi.
func newSources(f flags, cfg *config.Config, node mounter.Node, mx *metrics.Metrics) (map[string]source.Source, error) {
	stateDir, err := filepath.Abs(f.stateDir)
	if err != nil {
		return nil, err
	}
	loopSource := loop.New(stateDir, node)
	loopSource.Metrics, loopSource.ImageRoots = mx, cfg.ImageRoots
	fuseSource, err := fuse.New(fuse.Options{StateDir: stateDir, Profiles: cfg.FuseProfiles,
		Daemons: node, Metrics: mx, ProbeInterval: f.fuseProbeInterval, ProbeTimeout: f.fuseProbeTimeout})
	if err != nil {
		return nil, err
	}
	return map[string]source.Source{loop.Type: loopSource, fuse.Type: fuseSource,
		nbd.Type: nbd.New(cfg.NBD, node, mx), iscsi.Type: iscsi.New(cfg.ISCSI, node, mx)}, nil
}

// newMounter returns the mounter: a client of the sidecar's socket when
// configured (the plugin then needs no privilege at all), else a mounter
// in this process, which needs them all. restarted registers what to do
// when the sidecar restarts.
func newMounter(ctx context.Context, f flags, cfg *config.Config) (node mounter.Node, restarted func(func()), closeFn func(), err error) {
	stateDir, err := filepath.Abs(f.stateDir)
	if err != nil {
		return nil, nil, nil, err
	}
	if f.mounterEndpoint != "" {
		p, err := endpoint.Path(f.mounterEndpoint)
		if err != nil {
			return nil, nil, nil, err
		}
		c := service.NewClient(p)
		return c, c.OnRestart, func() { _ = c.Close() }, nil
	}
	raiseFileLimit()
	// Tools (mkfs, blkid, ...) are started by a small child made now,
	// before this process holds one open file per staged loop device:
	// starting them from here would copy that whole file table each time.
	if err := toolrun.StartSpawner(); err != nil {
		klog.ErrorS(err, "Cannot start the tool spawner; tools are started directly")
	}
	local, err := mounter.NewNode(ctx, mounter.Options{StateDir: stateDir, KubeletDir: f.kubeletDir,
		RecordsDir: mounter.DefaultRecordsDir(stateDir), Config: cfg})
	if err != nil {
		return nil, nil, nil, err
	}
	return local, func(func()) {}, func() { _ = local.Close() }, nil
}

// daemonUsage asks the mounter, at each scrape, what the FUSE daemons use.
func daemonUsage(u mounter.DaemonUsages) func(context.Context) ([]metrics.DaemonUsage, error) {
	return func(ctx context.Context) ([]metrics.DaemonUsage, error) {
		all, err := u.DaemonUsage(ctx)
		out := make([]metrics.DaemonUsage, 0, len(all))
		for _, d := range all {
			out = append(out, metrics.DaemonUsage{Volume: d.VolumeID, Profile: d.Profile, InCgroup: d.Cgroup != "",
				LimitsEnforced: d.LimitsEnforced, HasMemory: d.HasMemory, MemoryBytes: d.MemoryBytes, CPUUsec: d.CPUUsec, OOMKills: d.OOMKills})
		}
		return out, err
	}
}

// raiseFileLimit makes room for one open file per staged loop volume
// (internal/fdlimit) and says how much room there is.
func raiseFileLimit() {
	lim, err := fdlimit.Raise(fdlimit.Want)
	if err != nil {
		klog.ErrorS(err, "Cannot raise the open file limit: it bounds the number of staged loop volumes (one open file each)", "soft", lim.Cur, "hard", lim.Max)
		return
	}
	klog.V(2).InfoS("Open file limit", "soft", lim.Cur, "hard", lim.Max)
}
