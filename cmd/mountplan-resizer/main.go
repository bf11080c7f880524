// Command mountplan-resizer is the node pod's side of the API server: it
// expands the PersistentVolumeClaims whose volumes live on its node
// (internal/resizer) and records Events when a volume in use on the node
// turns abnormal or heals (internal/healthevents). It runs next to the
// plugin, whose Controller and Node services it calls on the plugin's
// socket, so that the plugin itself holds no API credentials.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/healthevents"
	"github.com/mountplan/mountplan/internal/resizer"
	"github.com/mountplan/mountplan/internal/topology"
	"github.com/mountplan/mountplan/internal/version"
)

func main() {
	var pluginEndpoint, nodeID, driverName, kubeconfig, healthAddress string
	var workers int
	var healthInterval time.Duration
	flag.StringVar(&pluginEndpoint, "plugin-endpoint", "unix:///csi/csi.sock", "the plugin's CSI socket")
	flag.StringVar(&nodeID, "node-id", "", "name of this node, as the plugin's --node-id (required)")
	flag.StringVar(&driverName, "driver-name", "mountplan.csi.io", "CSI driver name")
	flag.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file; empty: the pod's service account")
	flag.IntVar(&workers, "workers", 4, "claims expanded at the same time")
	flag.DurationVar(&healthInterval, "health-events-interval", 10*time.Second, "how often the health of each volume in use on the node is asked, for Events on its claim and pods; 0: no such Events")
	flag.StringVar(&healthAddress, "health-address", "", "serve /healthz on this address (host:port) for kubelet's liveness probe; empty: off")
	showVersion := flag.Bool("version", false, "print the version, git revision, build date and Go version, and exit")
	klog.InitFlags(nil)
	flag.Parse()
	if *showVersion {
		version.Get().Print(os.Stdout, "mountplan-resizer")
		return
	}
	if err := run(pluginEndpoint, nodeID, driverName, kubeconfig, healthAddress, workers, healthInterval); err != nil {
		klog.ErrorS(err, "mountplan-resizer failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(pluginEndpoint, nodeID, driverName, kubeconfig, healthAddress string, workers int, healthInterval time.Duration) error {
	if nodeID == "" {
		return fmt.Errorf("--node-id is required")
	}
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return err
	}
	cfg.UserAgent = "mountplan-resizer"
	kube, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return err
	}
	conn, err := endpoint.Dial(pluginEndpoint)
	if err != nil {
		return err
	}
	defer conn.Close()
	r, err := resizer.New(resizer.Options{DriverName: driverName, TopologyKey: topology.Key, NodeID: nodeID,
		Kube: kube, Controller: csi.NewControllerClient(conn)})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background())
	if _, _, err := serveHealth(ctx, healthAddress); err != nil {
		return err
	}
	if healthInterval > 0 {
		pvcs, pvs := r.Listers()
		w, err := healthevents.New(healthevents.Options{DriverName: driverName, NodeID: nodeID, Kube: kube,
			Node: csi.NewNodeClient(conn), PVCs: pvcs, PVs: pvs, Interval: healthInterval})
		if err != nil {
			return err
		}
		go func() {
			if err := w.Run(ctx); err != nil {
				klog.FromContext(ctx).Error(err, "Volume health Events stopped")
			}
		}()
	}
	return r.Run(ctx, workers)
}
