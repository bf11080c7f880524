package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	restclient "k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/internal/topology"
	"github.com/mountplan/mountplan/internal/volview"
)

// runWith runs the command line against cs and returns its exit status
// and what it wrote to stdout and stderr.
func runWith(t *testing.T, cs kubernetes.Interface, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	connect := func(clientcmd.ClientConfig) (kubernetes.Interface, error) { return cs, nil }
	err := run(context.Background(), args, &out, &errOut, connect)
	return exitCode(err, &errOut), out.String(), errOut.String()
}

// --help is asked for, not a mistake: usage on stdout, exit 0, at every
// place an operator types it.
func TestHelpExitsZero(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}, {"forget-node", "--help"}, {"volumes", "-h"}, {"volumes", "node-a", "--help"}} {
		code, out, errOut := runWith(t, fake.NewClientset(), args...)
		if code != 0 {
			t.Errorf("%q: exit %d, want 0 (stderr %q)", args, code, errOut)
		}
		for _, want := range []string{"usage: kubectl mountplan", "forget-node NODE", "volumes [NODE]", "-o", "--namespace", "--context", "--kubeconfig"} {
			if !strings.Contains(out, want) {
				t.Errorf("%q: usage on stdout lacks %q:\n%s", args, want, out)
			}
		}
	}
	// The usage's list of flags is written by hand: every flag is in it.
	_, out, _ := runWith(t, fake.NewClientset(), "--help")
	newFlagSet(&options{}).VisitAll(func(f *flag.Flag) {
		if dashes := map[bool]string{true: "-", false: "--"}[len(f.Name) == 1]; !strings.Contains(out, dashes+f.Name+" ") && !strings.Contains(out, dashes+f.Name+",") {
			t.Errorf("usage lacks %s%s", dashes, f.Name)
		}
	})
}

// A command line that is wrong exits non-zero and says why.
func TestBadCommandLine(t *testing.T) {
	for _, args := range [][]string{{}, {"frobnicate"}, {"forget-node"}, {"forget-node", "a", "b"}, {"volumes", "--yes"}, {"forget-node", "a", "-o", "json"}, {"volumes", "--no-such-flag"}} {
		code, _, errOut := runWith(t, fake.NewClientset(), args...)
		if code == 0 || !strings.Contains(errOut, "kubectl mountplan") {
			t.Errorf("%q: exit %d, stderr %q; want a non-zero exit and the reason", args, code, errOut)
		}
	}
}

func gonePV(name, driver, node string) *corev1.PersistentVolume {
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: "uid-" + "name"},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: name}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: topology.Key, Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}}}},
		},
	}
}

// Flags go before or after the node's name, as kubectl takes them; the
// driver and --yes given anywhere are the ones used.
func TestForgetNodeFlagsInAnyOrder(t *testing.T) {
	for _, args := range [][]string{
		{"forget-node", "gone", "--driver-name", "other.csi.io", "--yes"},
		{"forget-node", "--driver-name", "other.csi.io", "--yes", "gone"},
		{"forget-node", "--driver-name=other.csi.io", "gone", "--yes"},
		// The old name still works, and says it is deprecated.
		{"--yes", "forget-node", "gone", "--driver", "other.csi.io"},
		{"--kubeconfig", "/dev/null", "forget-node", "--yes", "--driver", "other.csi.io", "--", "gone"},
	} {
		cs := fake.NewClientset(gonePV("pv-gone", "other.csi.io", "gone"), gonePV("pv-mine", "mountplan.csi.io", "gone"))
		code, out, errOut := runWith(t, cs, args...)
		if code != 0 {
			t.Errorf("%q: exit %d: %s", args, code, errOut)
			continue
		}
		if old := slices.Contains(args, "--driver"); old != strings.Contains(errOut, "--driver is deprecated and will be removed: use --driver-name") {
			t.Errorf("%q: deprecated --driver given %v, stderr %q", args, old, errOut)
		}
		if !strings.Contains(out, "deleted persistentvolume pv-gone") {
			t.Errorf("%q: output lacks the delete of pv-gone:\n%s", args, out)
		}
		if _, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), "pv-gone", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("%q: pv-gone is still there (%v)", args, err)
		}
		if _, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), "pv-mine", metav1.GetOptions{}); err != nil {
			t.Errorf("%q: the other driver's volume pv-mine: %v", args, err)
		}
	}
}

// pluginPod is a node pod of the chart, with the plugin's metrics on port.
func pluginPod(ns, name, node, port string) *corev1.Pod {
	args := []string{"--node-id=$(NODE_NAME)", "--v=2"}
	if port != "" {
		args = append(args, "--metrics-address=:"+port)
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
			Labels: map[string]string{"app.kubernetes.io/name": "mountplan", "app.kubernetes.io/component": "node"}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{
			{Name: "csi-provisioner", Args: []string{"--csi-address=/csi/csi.sock"}},
			{Name: "plugin", Args: args},
		}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning},
	}
}

type rawResponse []byte

func (r rawResponse) DoRaw(context.Context) ([]byte, error) { return r, nil }
func (r rawResponse) Stream(context.Context) (io.ReadCloser, error) {
	return nil, errors.New("not streamed")
}

// withPlugins answers each pod's /debug/volumes through the API server's
// proxy with a report naming the pod's node, and records what was asked.
func withPlugins(t *testing.T, objs ...runtime.Object) (*fake.Clientset, *[]string) {
	cs := fake.NewClientset(objs...)
	var asked []string
	cs.PrependProxyReactor("pods", func(a k8stesting.Action) (bool, restclient.ResponseWrapper, error) {
		p := a.(k8stesting.ProxyGetAction)
		asked = append(asked, p.GetNamespace()+"/"+p.GetName()+":"+p.GetPort()+p.GetPath())
		pod, err := cs.Tracker().Get(corev1.SchemeGroupVersion.WithResource("pods"), p.GetNamespace(), p.GetName())
		if err != nil {
			return true, nil, err
		}
		node := pod.(*corev1.Pod).Spec.NodeName
		r := volview.Report{Node: node, Volumes: []volview.Volume{
			{ID: "vol-b-" + node, Type: "loop", Kind: "filesystem", Device: "/dev/loop3", Stage: "staged", Health: volview.Health{Status: "ok"},
				Consumers: []volview.Consumer{{Kind: volview.KindPublish, Path: "/var/lib/kubelet/pods/u/volumes/x/mount", Kernel: volview.Kernel{State: volview.Present}}}},
			{ID: "vol-a-" + node, Type: "fuse", Kind: "filesystem", Stage: "staged", Health: volview.Health{Status: "ok"}},
		}}
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return true, rawResponse(b), nil
	})
	return cs, &asked
}

type listed struct {
	Node      string             `json:"node"`
	ID        string             `json:"id"`
	Type      string             `json:"type"`
	Stage     string             `json:"stage"`
	Device    string             `json:"device"`
	Health    *volview.Health    `json:"health"`
	Consumers []volview.Consumer `json:"consumers"`
}

// -o json and -o yaml: one object per volume with its node, sorted by node
// then volume, the fields the table shows.
func TestVolumesOutput(t *testing.T) {
	objs := []runtime.Object{pluginPod("kube-system", "mp-node-2", "n2", "29654"), pluginPod("kube-system", "mp-node-1", "n1", "29654"),
		pluginPod("elsewhere", "mp-node-3", "n3", "9000")}
	decode := map[string]func([]byte, any) error{"json": json.Unmarshal, "yaml": func(b []byte, v any) error { return yaml.Unmarshal(b, v) }}
	for _, format := range []string{"json", "yaml"} {
		cs, asked := withPlugins(t, objs...)
		code, out, errOut := runWith(t, cs, "volumes", "-o", format, "-n", "kube-system")
		if code != 0 {
			t.Fatalf("-o %s: exit %d: %s", format, code, errOut)
		}
		var got []listed
		if err := decode[format]([]byte(out), &got); err != nil {
			t.Fatalf("-o %s: %v:\n%s", format, err, out)
		}
		var ids []string
		for _, v := range got {
			ids = append(ids, v.Node+"/"+v.ID)
			if v.Type == "" || v.Stage == "" || v.Health == nil || v.Health.Status != "ok" {
				t.Errorf("-o %s: %+v lacks the table's fields", format, v)
			}
		}
		if want := []string{"n1/vol-a-n1", "n1/vol-b-n1", "n2/vol-a-n2", "n2/vol-b-n2"}; !slices.Equal(ids, want) {
			t.Errorf("-o %s -n kube-system lists %v, want %v", format, ids, want)
		}
		if len(got) == 4 && (got[1].Device != "/dev/loop3" || len(got[1].Consumers) != 1 || got[1].Consumers[0].Kernel.State != volview.Present) {
			t.Errorf("-o %s: %+v lacks its device or consumer", format, got[1])
		}
		slices.Sort(*asked)
		if want := []string{"kube-system/mp-node-1:29654/debug/volumes", "kube-system/mp-node-2:29654/debug/volumes"}; !slices.Equal(*asked, want) {
			t.Errorf("-o %s asked %v through the API server, want %v", format, *asked, want)
		}
	}

	// One node, the flags before it; without -n every namespace.
	cs, _ := withPlugins(t, objs...)
	code, out, errOut := runWith(t, cs, "volumes", "--output=json", "n3")
	var got []listed
	if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil || len(got) != 2 || got[0].Node != "n3" {
		t.Errorf("volumes --output=json n3: exit %d, %v, %+v (stderr %q)", code, err, got, errOut)
	}

	// The table is the default.
	cs, _ = withPlugins(t, objs...)
	code, out, errOut = runWith(t, cs, "-n", "kube-system", "volumes")
	if code != 0 || !strings.Contains(out, "VOLUME") || !strings.Contains(out, "vol-a-n1") || !strings.Contains(out, "node n2") {
		t.Errorf("volumes: exit %d:\n%s\nstderr %q", code, out, errOut)
	}
}

// A plugin whose metrics are off cannot be asked: the error says how to
// turn them on, and the exit is non-zero.
func TestVolumesWithoutMetrics(t *testing.T) {
	cs, _ := withPlugins(t, pluginPod("kube-system", "mp-node-1", "n1", ""))
	code, _, errOut := runWith(t, cs, "volumes", "n1")
	if code == 0 || !strings.Contains(errOut, "metrics.enabled=true") {
		t.Errorf("exit %d, stderr %q; want an error that says to set metrics.enabled=true", code, errOut)
	}
	code, _, errOut = runWith(t, cs, "volumes", "no-such-node")
	if code == 0 || !strings.Contains(errOut, "no-such-node") {
		t.Errorf("a node without the plugin: exit %d, stderr %q", code, errOut)
	}
}

// A wrong -o is an error that names the values it takes.
func TestVolumesBadOutput(t *testing.T) {
	cs, _ := withPlugins(t, pluginPod("kube-system", "mp-node-1", "n1", "29654"))
	code, out, errOut := runWith(t, cs, "volumes", "-o", "xml")
	if code == 0 || !strings.Contains(errOut, "table, json, yaml") || out != "" {
		t.Errorf("-o xml: exit %d, stdout %q, stderr %q; want a non-zero exit naming table, json, yaml", code, out, errOut)
	}
}

const kubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: a
  cluster: {server: "https://a.example:6443"}
- name: b
  cluster: {server: "https://b.example:6443"}
users:
- name: u
  user: {token: "t"}
contexts:
- name: a
  context: {cluster: a, user: u, namespace: from-a}
- name: b
  context: {cluster: b, user: u}
current-context: a
`

// --kubeconfig, --context and -n/--namespace reach the client as
// kubectl's own flags would.
func TestKubeconfigContextNamespace(t *testing.T) {
	file := filepath.Join(t.TempDir(), "config")
	if err := os.WriteFile(file, []byte(kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KUBECONFIG", "")
	for _, c := range []struct {
		args       []string
		host, ns   string
		explicitNS bool
	}{
		{[]string{"volumes", "--kubeconfig", file}, "https://a.example:6443", "from-a", false},
		{[]string{"volumes", "--kubeconfig=" + file, "--context", "b"}, "https://b.example:6443", "default", false},
		{[]string{"--context=b", "-n", "kube-system", "volumes", "--kubeconfig", file}, "https://b.example:6443", "kube-system", true},
		{[]string{"forget-node", "gone", "--namespace", "x", "--kubeconfig", file}, "https://a.example:6443", "x", true},
	} {
		var host, ns string
		var explicit bool
		connect := func(cc clientcmd.ClientConfig) (kubernetes.Interface, error) {
			cfg, err := cc.ClientConfig()
			if err != nil {
				return nil, err
			}
			host = cfg.Host
			ns, explicit, err = cc.Namespace()
			return fake.NewClientset(), err
		}
		var out, errOut bytes.Buffer
		_ = run(context.Background(), c.args, &out, &errOut, connect)
		if host != c.host || ns != c.ns || explicit != c.explicitNS {
			t.Errorf("%q: server %q namespace %q (explicit %v), want %q %q (%v)", c.args, host, ns, explicit, c.host, c.ns, c.explicitNS)
		}
	}
}
