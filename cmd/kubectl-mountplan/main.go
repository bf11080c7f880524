// Command kubectl-mountplan is mountplan's kubectl plugin: on the PATH,
// `kubectl mountplan ...` runs it with the operator's kubeconfig and
// credentials.
//
//	kubectl mountplan forget-node NODE [--driver mountplan.csi.io] [--yes]
//
// forget-node shows what a node that is gone for good left of the driver's
// objects in the API (its node-local PersistentVolumes, the claims bound
// to them, its CSIStorageCapacity objects); with --yes it deletes them.
// The node must be deleted first: the data on it is lost with it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mountplan/mountplan/internal/forgetnode"
)

const usage = `usage: kubectl mountplan forget-node NODE [--driver NAME] [--yes] [--kubeconfig FILE]

forget-node: NODE is gone for good (deleted from the cluster); show what it
left of the driver's objects: its PersistentVolumes (node-local, their data
was on it), the claims bound to them, its CSIStorageCapacity objects. With
--yes, delete the claims, delete the volumes and take the provisioner's
finalizer off them (the provisioner that would have deleted them ran on
NODE), and delete the capacities.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubectl mountplan:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 0 || args[0] != "forget-node" {
		fmt.Fprint(os.Stderr, usage)
		return errors.New("one command: forget-node")
	}
	fs := flag.NewFlagSet("forget-node", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	driver := fs.String("driver", "mountplan.csi.io", "CSI driver name (the chart's driverName)")
	yes := fs.Bool("yes", false, "delete what the node left (without it, only show it)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)")
	timeout := fs.Duration("timeout", time.Minute, "how long the whole command may take")
	// The node's name first, as kubectl's plugins take it, flags after.
	if len(args) < 2 || args[1] == "" || args[1][0] == '-' {
		fs.Usage()
		return errors.New("forget-node: the node's name is needed")
	}
	node := args[1]
	if err := fs.Parse(args[2:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("forget-node: unexpected %q", fs.Args())
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = *kubeconfig
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	p, err := forgetnode.Make(ctx, cs, *driver, node)
	if err != nil {
		return err
	}
	p.Print(out)
	if p.Empty() {
		return nil
	}
	if !*yes {
		fmt.Fprintf(out, "run again with --yes to delete them: the data of these volumes was on %s and is lost with it\n", node)
		return nil
	}
	return p.Apply(ctx, cs, out)
}
