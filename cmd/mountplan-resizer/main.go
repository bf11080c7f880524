// Command mountplan-resizer expands the PersistentVolumeClaims whose volumes
// live on its node (internal/resizer). It runs in the node pod next to the
// plugin, whose Controller service it calls on the plugin's socket.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/resizer"
	"github.com/mountplan/mountplan/internal/topology"
)

func main() {
	var pluginEndpoint, nodeID, driverName, kubeconfig string
	var workers int
	flag.StringVar(&pluginEndpoint, "plugin-endpoint", "unix:///csi/csi.sock", "the plugin's CSI socket")
	flag.StringVar(&nodeID, "node-id", "", "name of this node, as the plugin's --node-id (required)")
	flag.StringVar(&driverName, "driver-name", "mountplan.csi.io", "CSI driver name")
	flag.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file; empty: the pod's service account")
	flag.IntVar(&workers, "workers", 4, "claims expanded at the same time")
	klog.InitFlags(nil)
	flag.Parse()
	if err := run(pluginEndpoint, nodeID, driverName, kubeconfig, workers); err != nil {
		klog.ErrorS(err, "mountplan-resizer failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(pluginEndpoint, nodeID, driverName, kubeconfig string, workers int) error {
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
	return r.Run(klog.NewContext(ctx, klog.Background()), workers)
}
