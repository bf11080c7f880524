package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/internal/volview"
)

// outputs are the formats of volumes' -o.
var outputs = []string{"table", "json", "yaml"}

// defaultSelector finds the chart's node pods (its node DaemonSet), whose
// container "plugin" serves /debug/volumes beside its metrics.
const defaultSelector = "app.kubernetes.io/name=mountplan,app.kubernetes.io/component=node"

// pluginContainer is the chart's name of the plugin's container.
const pluginContainer = "plugin"

// listedVolume is one volume of -o json and -o yaml: what the table shows
// of it, with its node (the table says the node above its volumes).
type listedVolume struct {
	Node string `json:"node"`
	volview.Volume
}

// listVolumes asks the plugin pod of node (of every node when "") for its
// /debug/volumes through the API server's proxy and prints the volumes.
// Nodes that cannot be asked are said on errOut, after the others are
// printed, and make the exit non-zero.
func listVolumes(ctx context.Context, cc clientcmd.ClientConfig, connect connectFunc, o options, node string, out, errOut io.Writer) error {
	cs, err := connect(cc)
	if err != nil {
		return err
	}
	ns := metav1.NamespaceAll
	if o.namespace != "" {
		ns = o.namespace
	}
	opts := metav1.ListOptions{LabelSelector: o.selector}
	if node != "" {
		opts.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
	}
	pods, err := cs.CoreV1().Pods(ns).List(ctx, opts)
	if err != nil {
		return fmt.Errorf("listing the plugin's pods (-l %s): %w", o.selector, err)
	}
	var found []corev1.Pod
	for _, p := range pods.Items {
		if node == "" || p.Spec.NodeName == node {
			found = append(found, p)
		}
	}
	where := "in any namespace"
	if ns != "" {
		where = "in namespace " + ns
	}
	switch {
	case len(found) == 0 && node != "":
		return fmt.Errorf("no plugin pod (-l %s) %s runs on node %s: is the node's name right, and -n the chart's namespace?", o.selector, where, node)
	case len(found) == 0:
		return fmt.Errorf("no plugin pod (-l %s) %s: is mountplan installed, and -n the chart's namespace?", o.selector, where)
	}
	slices.SortFunc(found, func(a, b corev1.Pod) int {
		return cmp.Or(cmp.Compare(a.Spec.NodeName, b.Spec.NodeName), cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	var reports []*volview.Report
	var errs []error
	for i := range found {
		r, err := askPlugin(ctx, cs, &found[i])
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, e := range r.Errors {
			fmt.Fprintf(errOut, "node %s: %s\n", found[i].Spec.NodeName, e)
		}
		reports = append(reports, r)
	}
	if err := writeVolumes(out, o.output, reports); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// askPlugin reads pod's /debug/volumes through the API server's proxy, on
// the port of its plugin's --metrics-address.
func askPlugin(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) (*volview.Report, error) {
	name := pod.Namespace + "/" + pod.Name
	if pod.Status.Phase != corev1.PodRunning {
		return nil, fmt.Errorf("node %s: pod %s is %s, not Running", pod.Spec.NodeName, name, pod.Status.Phase)
	}
	port := metricsPort(pod)
	if port == "" {
		return nil, fmt.Errorf("node %s: the plugin in pod %s serves no metrics, so no /debug/volumes: upgrade the chart with --set metrics.enabled=true", pod.Spec.NodeName, name)
	}
	b, err := cs.CoreV1().Pods(pod.Namespace).ProxyGet("http", pod.Name, port, "/debug/volumes", nil).DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("node %s: asking pod %s for /debug/volumes on port %s through the API server: %w", pod.Spec.NodeName, name, port, err)
	}
	var r volview.Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("node %s: pod %s: not a volume listing: %w", pod.Spec.NodeName, name, err)
	}
	if r.Node == "" {
		r.Node = pod.Spec.NodeName
	}
	return &r, nil
}

// metricsPort is the port of the plugin container's --metrics-address
// (the chart sets --metrics-address=:PORT), "" when it has none.
func metricsPort(pod *corev1.Pod) string {
	for _, c := range pod.Spec.Containers {
		if c.Name != pluginContainer {
			continue
		}
		args := append(slices.Clone(c.Command), c.Args...)
		for i, a := range args {
			var addr string
			switch {
			case strings.HasPrefix(a, "--metrics-address="), strings.HasPrefix(a, "-metrics-address="):
				_, addr, _ = strings.Cut(a, "=")
			case (a == "--metrics-address" || a == "-metrics-address") && i+1 < len(args):
				addr = args[i+1]
			default:
				continue
			}
			if i := strings.LastIndex(addr, ":"); i >= 0 && i+1 < len(addr) {
				return addr[i+1:]
			}
		}
	}
	return ""
}

// writeVolumes prints the reports: a table per node, or one list of
// every volume with its node, in the order of the nodes and, within a
// node, of the volumes' IDs, so that the same state prints the same.
func writeVolumes(w io.Writer, format string, reports []*volview.Report) error {
	for _, r := range reports {
		slices.SortFunc(r.Volumes, func(a, b volview.Volume) int { return cmp.Compare(a.ID, b.ID) })
	}
	if format == "table" {
		for i, r := range reports {
			if i > 0 {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "node %s\n", r.Node)
			if err := volview.WriteTable(w, r); err != nil {
				return err
			}
		}
		return nil
	}
	list := []listedVolume{} // [] rather than null when there is none
	for _, r := range reports {
		for _, v := range r.Volumes {
			list = append(list, listedVolume{Node: r.Node, Volume: v})
		}
	}
	var b []byte
	var err error
	if format == "json" {
		b, err = json.MarshalIndent(list, "", "  ")
		b = append(b, '\n')
	} else {
		b, err = yaml.Marshal(list)
	}
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}
