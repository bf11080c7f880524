package chart_test

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountplan/mountplan/test/chart/chartrender"
)

// podMonitor is the part of monitoring.coreos.com/v1 PodMonitor the chart
// renders (the Prometheus Operator's module is not a dependency); a field
// the chart renders that is not here fails the strict decode.
type podMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		PodMetricsEndpoints []struct {
			Port        string `json:"port"`
			Path        string `json:"path"`
			Interval    string `json:"interval"`
			Relabelings []struct {
				SourceLabels []string `json:"sourceLabels"`
				TargetLabel  string   `json:"targetLabel"`
			} `json:"relabelings"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// selects reports whether a selector of these labels picks the node pods.
func (r *rendered) selectsNodePods(sel map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if r.ds.Spec.Template.Labels[k] != v {
			return false
		}
	}
	for k, v := range sel {
		if r.mds.Spec.Template.Labels[k] != v {
			return true // and not the mounter's
		}
	}
	return false
}

func TestMetricsService(t *testing.T) {
	if r := render(t, nil); r.metricsSvc != nil || r.podMonitor != nil {
		t.Fatal("metrics are off by default, yet a Service or a PodMonitor is rendered")
	}
	r := render(t, map[string]any{"metrics": map[string]any{"enabled": true, "port": 9999}})
	s := r.metricsSvc
	if s == nil {
		t.Fatal("metrics.enabled renders no Service")
	}
	if s.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("clusterIP %q: want a headless Service (one endpoint per node, no balancing)", s.Spec.ClusterIP)
	}
	if !r.selectsNodePods(s.Spec.Selector) {
		t.Errorf("selector %v does not pick the plugin's pods alone", s.Spec.Selector)
	}
	if len(s.Spec.Ports) != 1 || s.Spec.Ports[0].Port != 9999 || s.Spec.Ports[0].TargetPort.String() != "metrics" {
		t.Errorf("ports %+v: want 9999 to the container port named metrics", s.Spec.Ports)
	}
	plugin := r.container(t, "plugin")
	if !hasPort(plugin, "metrics", 9999) {
		t.Errorf("the plugin container has no port metrics 9999: %+v", plugin.Ports)
	}
	r = render(t, map[string]any{"metrics": map[string]any{"enabled": true, "service": map[string]any{"enabled": false}}})
	if r.metricsSvc != nil {
		t.Error("metrics.service.enabled=false still renders the Service")
	}
}

func hasPort(c *corev1.Container, name string, port int32) bool {
	for _, p := range c.Ports {
		if p.Name == name && p.ContainerPort == port {
			return true
		}
	}
	return false
}

func TestPodMonitor(t *testing.T) {
	r := render(t, map[string]any{"metrics": map[string]any{"enabled": true,
		"podMonitor": map[string]any{"enabled": true, "interval": "15s", "labels": map[string]any{"release": "prom"}}}})
	m := r.podMonitor
	if m == nil {
		t.Fatal("metrics.podMonitor.enabled renders no PodMonitor")
	}
	if m.Labels["release"] != "prom" {
		t.Errorf("labels %v lack podMonitor.labels", m.Labels)
	}
	if !r.selectsNodePods(m.Spec.Selector.MatchLabels) {
		t.Errorf("selector %v does not pick the plugin's pods alone", m.Spec.Selector.MatchLabels)
	}
	if ns := m.Spec.NamespaceSelector.MatchNames; len(ns) != 1 || ns[0] != chartrender.Namespace {
		t.Errorf("namespaces %v, want the release's", ns)
	}
	eps := m.Spec.PodMetricsEndpoints
	if len(eps) != 1 || eps[0].Port != "metrics" || eps[0].Interval != "15s" || eps[0].Path != "/metrics" {
		t.Errorf("endpoints %+v: want port metrics, /metrics, every 15s", eps)
	}
	// Without the plugin's metrics there is nothing to scrape: the render
	// fails saying so rather than a monitor of a port nobody serves.
	_, err := chartrender.Render(chartDir, map[string]any{"metrics": map[string]any{"podMonitor": map[string]any{"enabled": true}}})
	if err == nil || !strings.Contains(err.Error(), "metrics.enabled") {
		t.Errorf("podMonitor without metrics.enabled: %v, want an error naming metrics.enabled", err)
	}
}

// TestHelmTestPod: helm test's pod asks the plugin's own CSI socket, from
// the plugin's image, with no privilege, and is never in deploy/.
func TestHelmTestPod(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		p := r.testPod
		if p == nil {
			t.Fatal("no helm test pod")
		}
		if p.Annotations["helm.sh/hook"] != "test" {
			t.Errorf("annotations %v: not a helm test hook", p.Annotations)
		}
		if p.Spec.RestartPolicy != corev1.RestartPolicyNever {
			t.Errorf("restartPolicy %q", p.Spec.RestartPolicy)
		}
		c := p.Spec.Containers[0]
		plugin := r.container(t, "plugin")
		if c.Image != plugin.Image || c.ImagePullPolicy != plugin.ImagePullPolicy {
			t.Errorf("image %s (%s), want the plugin's %s (%s): nothing else is on a node", c.Image, c.ImagePullPolicy, plugin.Image, plugin.ImagePullPolicy)
		}
		if len(c.Command) < 2 || c.Command[0] != sidecarBinary || c.Command[1] != "probe" {
			t.Fatalf("command %v: want %s probe", c.Command, sidecarBinary)
		}
		a := map[string]string{}
		for _, arg := range c.Command[2:] {
			k, v, _ := strings.Cut(arg, "=")
			a[k] = v
		}
		wantArg(t, plugin, "--endpoint", a["--plugin-endpoint"])
		if a["--driver-name"] != r.str(t, "driverName") {
			t.Errorf("--driver-name %q, want %q", a["--driver-name"], r.str(t, "driverName"))
		}
		// The socket's directory is the plugin's, from the same host path.
		_, tv := mountAtPod(t, p, &c, "/csi")
		_, pv := r.mountAt(t, plugin, "/csi")
		if tv.HostPath == nil || pv.HostPath == nil || tv.HostPath.Path != pv.HostPath.Path {
			t.Errorf("the test mounts %+v at /csi, the plugin %+v", tv.HostPath, pv.HostPath)
		}
		sc := c.SecurityContext
		if sc == nil || sc.Privileged != nil && *sc.Privileged || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
			t.Errorf("securityContext %+v: want no capability", sc)
		}
		if p.Spec.AutomountServiceAccountToken == nil || *p.Spec.AutomountServiceAccountToken {
			t.Error("the test pod gets a ServiceAccount token it does not use")
		}
	})
	if r := render(t, map[string]any{"tests": map[string]any{"enabled": false}}); r.testPod != nil {
		t.Error("tests.enabled=false still renders the test pod")
	}
	files, err := chartrender.DeployFiles(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range files {
		if strings.Contains(string(b), "helm.sh/hook") {
			t.Errorf("deploy/%s holds a helm hook, which kubectl apply would create as a plain object", name)
		}
	}
}

func mountAtPod(t *testing.T, p *corev1.Pod, c *corev1.Container, path string) (*corev1.VolumeMount, *corev1.Volume) {
	t.Helper()
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath != path {
			continue
		}
		for j := range p.Spec.Volumes {
			if p.Spec.Volumes[j].Name == c.VolumeMounts[i].Name {
				return &c.VolumeMounts[i], &p.Spec.Volumes[j]
			}
		}
	}
	t.Fatalf("%s mounts nothing at %s", c.Name, path)
	return nil, nil
}

// TestNamespace: off by default; on, the release namespace with Pod
// Security level privileged, which the mounter's pod needs, kept on uninstall.
func TestNamespace(t *testing.T) {
	if r := render(t, nil); r.ns != nil {
		t.Fatal("a Namespace is rendered by default")
	}
	r := render(t, map[string]any{"namespace": map[string]any{"create": true, "labels": map[string]any{"team": "storage"}}})
	if r.ns == nil {
		t.Fatal("namespace.create renders no Namespace")
	}
	if r.ns.Name != chartrender.Namespace {
		t.Errorf("namespace %q, want the release's %q", r.ns.Name, chartrender.Namespace)
	}
	for _, mode := range []string{"enforce", "audit", "warn"} {
		if v := r.ns.Labels["pod-security.kubernetes.io/"+mode]; v != "privileged" {
			t.Errorf("pod-security.kubernetes.io/%s = %q, want privileged", mode, v)
		}
	}
	if r.ns.Labels["team"] != "storage" {
		t.Errorf("labels %v lack namespace.labels", r.ns.Labels)
	}
	if r.ns.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Error("an uninstall would delete the namespace and all else in it")
	}
	// What the label admits is what the mounter needs.
	if sc := r.mds.Spec.Template.Spec.Containers[0].SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Error("the mounter is not privileged: the namespace's level should say what it needs")
	}
}
