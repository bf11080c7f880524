package chart_test

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/chart/chartrender"
)

var (
	chartDir  = filepath.Join("..", "..", "charts", "mountplan")
	deployDir = filepath.Join("..", "..", "deploy")
)

// Defaults of values.yaml the invariants below refer to.
const (
	defaultKubeletDir = "/var/lib/kubelet"
	defaultDriverName = "mountplan.csi.io"
	defaultStateDir   = "/var/lib/mountplan"
	defaultHealthPort = 29653
)

// Fixed contract between the chart and the binaries.
const (
	pluginBinary    = "/usr/local/bin/mountplan-plugin"
	sidecarBinary   = "/usr/local/bin/mountplan-sidecar"
	resizerBinary   = "/usr/local/bin/mountplan-resizer"
	csiEndpoint     = "unix:///csi/csi.sock"
	mounterEndpoint = "unix:///mounter/mounter.sock"
	configPath      = "/etc/mountplan/config.yaml"
)

// valueSets are the value overrides every test renders and checks.
var valueSets = []struct {
	name   string
	values map[string]any
}{
	{"default", nil},
	{"kubeletDir", map[string]any{"kubeletDir": "/var/lib/k0s/kubelet/"}},
	{"driverName", map[string]any{"driverName": "loop.storage.example.com"}},
	{"stateDir", map[string]any{"stateDir": "/srv/mountplan"}},
	{"metrics", map[string]any{"metrics": map[string]any{"enabled": true, "port": 9810}}},
	{"noStorageClass", map[string]any{"storageClass": map[string]any{"create": false}}},
	{"defaultStorageClass", map[string]any{"storageClass": map[string]any{"isDefault": true, "fsType": "xfs"}}},
	{"hostNetwork", map[string]any{"hostNetwork": true}},
	{"podNetwork", map[string]any{"hostNetwork": false, "healthPort": 9808}},
	{"mounterDirs", map[string]any{"mounter": map[string]any{"socketDir": "/run/mountplan/", "recordsDir": "/var/lib/mountplan-records"}}},
	{"sidecarRegistration", map[string]any{"registration": "sidecar"}},
	{"sidecarRegistrationPodNetwork", map[string]any{"registration": "sidecar", "hostNetwork": false, "healthPort": 9808}},
	{"sidecarRegistrationHostNetwork", map[string]any{"registration": "sidecar", "hostNetwork": true}},
	{"noResizer", map[string]any{"resizer": map[string]any{"enabled": false}}},
	{"resizerHealthPort", map[string]any{"hostNetwork": true, "resizer": map[string]any{"healthPort": 9809}}},
	{"snapshots", map[string]any{"snapshots": map[string]any{"enabled": true}}},
	{"snapshotsDefaultClass", map[string]any{"driverName": "loop.storage.example.com",
		"snapshots": map[string]any{"enabled": true, "volumeSnapshotClass": map[string]any{"name": "nightly", "isDefault": true, "deletionPolicy": "Retain"}}}},
	{"noStorageCapacity", map[string]any{"storageCapacity": map[string]any{"enabled": false}}},
	{"noSELinuxMount", map[string]any{"csiDriver": map[string]any{"seLinuxMount": false}}},
	{"snapshotsNoClass", map[string]any{"snapshots": map[string]any{"enabled": true, "volumeSnapshotClass": map[string]any{"create": false}}}},
	// values.yaml's example, and roots shared with imageRoots or under the state dir.
	{"fuseProfiles", map[string]any{"config": map[string]any{
		"imageRoots": []any{"/srv/images", "/srv/shared", "/var/lib/mountplan/images"},
		"fuseProfiles": []any{
			map[string]any{"name": "squashfuse", "binary": "/usr/bin/squashfuse",
				"args":   []any{"-f", "{source}", "{mountpoint}", "-o", "allow_other"},
				"source": map[string]any{"roots": []any{"/srv/squashfs", "/srv/shared"}}, "readyTimeout": "10s"},
			map[string]any{"name": "sshfs", "binary": "/usr/bin/sshfs",
				"args":   []any{"-f", "{source}", "{mountpoint}"},
				"source": map[string]any{"pattern": "[a-z]+@[a-z.]+:[a-z/]*"}},
		},
	}}},
	// Every source kind: NBD servers, sockets (one shared with an image root, one
	// under the state dir) and TLS from a Secret; iSCSI portals with the node
	// records and the initiator name outside /etc/iscsi.
	{"networkSources", networkSources},
	{"everything", map[string]any{
		"kubeletDir":   "/var/snap/microk8s/common/var/lib/kubelet",
		"driverName":   "other.example.org",
		"stateDir":     "/data/mp",
		"metrics":      map[string]any{"enabled": true},
		"registration": "sidecar",
		"config": map[string]any{
			"imageRoots":  []any{"/srv/images"},
			"mountPolicy": map[string]any{"allowSuidDev": true, "types": []any{"ext4", "bind"}},
		},
		"tolerations":       []any{map[string]any{"key": "storage", "operator": "Exists", "effect": "NoSchedule"}},
		"priorityClassName": "custom",
		"serviceAccount":    map[string]any{"name": "mp-node"},
		"imagePullSecrets":  []any{map[string]any{"name": "regcred"}},
	}},
}

// rendered is one render of the chart, every document decoded strictly.
type rendered struct {
	values map[string]any // effective values (chart defaults + overrides)
	text   string         // every document, in template order
	objs   []renderedObj

	// ds is <fullname>-node (the plugin and the kubernetes-csi sidecars),
	// mds <fullname>-mounter (the mounter alone).
	ds, mds *appsv1.DaemonSet
	driver  *storagev1.CSIDriver
	sc      *storagev1.StorageClass
	cm      *corev1.ConfigMap
	sa      *corev1.ServiceAccount
	role    *rbacv1.ClusterRole
	binding *rbacv1.ClusterRoleBinding
	vsc     *volumeSnapshotClass
	// nsRole and nsBinding are the provisioner's in the release namespace
	// (CSIStorageCapacity), with storageCapacity.enabled only.
	nsRole    *rbacv1.Role
	nsBinding *rbacv1.RoleBinding
	// The optional extras: metrics' Service and PodMonitor, helm test's
	// pod, the release namespace.
	metricsSvc *corev1.Service
	podMonitor *podMonitor
	testPod    *corev1.Pod
	ns         *corev1.Namespace

	// rawConfig is the ConfigMap's config.yaml; config is the same file read by
	// the plugin's own loader.
	rawConfig map[string]any
	config    *config.Config
}

type renderedObj struct {
	kind, apiVersion, name, namespace, template string
}

// decoders maps each kind the chart may render to its expected apiVersion and a
// typed object. A kind not listed here fails the test.
var decoders = map[string]struct {
	apiVersion string
	new        func() any
}{
	"DaemonSet":           {"apps/v1", func() any { return &appsv1.DaemonSet{} }},
	"CSIDriver":           {"storage.k8s.io/v1", func() any { return &storagev1.CSIDriver{} }},
	"StorageClass":        {"storage.k8s.io/v1", func() any { return &storagev1.StorageClass{} }},
	"ConfigMap":           {"v1", func() any { return &corev1.ConfigMap{} }},
	"ServiceAccount":      {"v1", func() any { return &corev1.ServiceAccount{} }},
	"ClusterRole":         {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.ClusterRole{} }},
	"ClusterRoleBinding":  {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.ClusterRoleBinding{} }},
	"Role":                {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.Role{} }},
	"RoleBinding":         {"rbac.authorization.k8s.io/v1", func() any { return &rbacv1.RoleBinding{} }},
	"VolumeSnapshotClass": {"snapshot.storage.k8s.io/v1", func() any { return &volumeSnapshotClass{} }},
	"Service":             {"v1", func() any { return &corev1.Service{} }},
	"Pod":                 {"v1", func() any { return &corev1.Pod{} }},
	"Namespace":           {"v1", func() any { return &corev1.Namespace{} }},
	"PodMonitor":          {"monitoring.coreos.com/v1", func() any { return &podMonitor{} }},
}

// volumeSnapshotClass is snapshot.storage.k8s.io/v1 VolumeSnapshotClass
// (external-snapshotter's client module is not a dependency).
type volumeSnapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Driver            string            `json:"driver"`
	DeletionPolicy    string            `json:"deletionPolicy"`
	Parameters        map[string]string `json:"parameters,omitempty"`
}

func effectiveValues(t *testing.T, overrides map[string]any) map[string]any {
	t.Helper()
	defaults, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	// Round-trip the overrides through YAML so that numbers are typed as helm sees them.
	b, err := yaml.Marshal(overrides)
	if err != nil {
		t.Fatal(err)
	}
	over, err := chartutil.ReadValues(b)
	if err != nil {
		t.Fatal(err)
	}
	return chartutil.CoalesceTables(over.AsMap(), defaults.AsMap())
}

func render(t *testing.T, overrides map[string]any) *rendered {
	t.Helper()
	ts, err := chartrender.Render(chartDir, overrides)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	r := &rendered{values: effectiveValues(t, overrides)}
	var all []string
	for _, tpl := range ts {
		for _, doc := range chartrender.Documents(tpl.Content) {
			all = append(all, doc)
			r.decode(t, tpl.Name, doc)
		}
	}
	r.text = strings.Join(all, "---\n")
	if r.ds == nil || r.mds == nil || r.driver == nil || r.cm == nil {
		t.Fatalf("render lacks the node or the mounter DaemonSet, the CSIDriver or the ConfigMap: %v", r.objs)
	}
	r.loadConfig(t)
	return r
}

// loadConfig reads the rendered config.yaml with internal/config, the plugin's
// strict loader, so that the chart cannot render a field the plugin rejects.
func (r *rendered) loadConfig(t *testing.T) {
	t.Helper()
	data, ok := r.cm.Data[filepath.Base(configPath)]
	if !ok {
		t.Fatalf("ConfigMap %s has no key %s", r.cm.Name, filepath.Base(configPath))
	}
	if err := yaml.Unmarshal([]byte(data), &r.rawConfig); err != nil {
		t.Fatalf("ConfigMap %s: config.yaml: %v", r.cm.Name, err)
	}
	f := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(f, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(f)
	if err != nil {
		t.Fatalf("the plugin rejects the rendered config: %v\n%s", err, data)
	}
	r.config = c
}

func (r *rendered) decode(t *testing.T, template, doc string) {
	t.Helper()
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
		t.Fatalf("%s: %v\n%s", template, err, doc)
	}
	d, ok := decoders[tm.Kind]
	if !ok {
		t.Fatalf("%s: kind %q has no decoder in this test: add it", template, tm.Kind)
	}
	if tm.APIVersion != d.apiVersion {
		t.Errorf("%s: %s %s: apiVersion %q, want %q", template, tm.Kind, tm.Metadata.Name, tm.APIVersion, d.apiVersion)
	}
	obj := d.new()
	// Strict: an unknown or duplicated field is an error.
	if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
		t.Fatalf("%s: %s %s: strict decode: %v", template, tm.Kind, tm.Metadata.Name, err)
	}
	for _, o := range r.objs {
		if o.kind == tm.Kind && o.name == tm.Metadata.Name {
			t.Fatalf("%s: %s %s rendered twice", template, tm.Kind, tm.Metadata.Name)
		}
	}
	r.objs = append(r.objs, renderedObj{tm.Kind, tm.APIVersion, tm.Metadata.Name, tm.Metadata.Namespace, template})
	set := func(dst any) {
		t.Helper()
		v := reflect.ValueOf(dst).Elem()
		if !v.IsNil() {
			t.Fatalf("%s: more than one %s", template, tm.Kind)
		}
		v.Set(reflect.ValueOf(obj))
	}
	switch o := obj.(type) {
	case *appsv1.DaemonSet:
		switch {
		case strings.HasSuffix(o.Name, "-node"):
			set(&r.ds)
		case strings.HasSuffix(o.Name, "-mounter"):
			set(&r.mds)
		default:
			t.Fatalf("%s: DaemonSet %s is neither <fullname>-node nor <fullname>-mounter", template, o.Name)
		}
	case *storagev1.CSIDriver:
		set(&r.driver)
	case *storagev1.StorageClass:
		set(&r.sc)
	case *corev1.ConfigMap:
		set(&r.cm)
	case *corev1.ServiceAccount:
		set(&r.sa)
	case *rbacv1.ClusterRole:
		set(&r.role)
	case *rbacv1.ClusterRoleBinding:
		set(&r.binding)
	case *rbacv1.Role:
		set(&r.nsRole)
	case *rbacv1.RoleBinding:
		set(&r.nsBinding)
	case *volumeSnapshotClass:
		set(&r.vsc)
	case *corev1.Service:
		set(&r.metricsSvc)
	case *podMonitor:
		set(&r.podMonitor)
	case *corev1.Pod:
		set(&r.testPod)
	case *corev1.Namespace:
		set(&r.ns)
	default:
		t.Fatalf("unhandled %T", o)
	}
}

// value reads a dotted path of the effective values.
func (r *rendered) value(t *testing.T, path string) any {
	t.Helper()
	v, err := chartutil.Values(r.values).PathValue(path)
	if err != nil {
		// PathValue only returns leaves; tables come from Table.
		tab, err2 := chartutil.Values(r.values).Table(path)
		if err2 != nil {
			t.Fatalf("value %s: %v", path, err)
		}
		return tab.AsMap()
	}
	return v
}

func (r *rendered) str(t *testing.T, path string) string {
	t.Helper()
	return fmt.Sprint(r.value(t, path))
}

func (r *rendered) num(t *testing.T, path string) int32 {
	t.Helper()
	n, err := strconv.Atoi(r.str(t, path))
	if err != nil {
		t.Fatalf("value %s: %v", path, err)
	}
	return int32(n)
}

func (r *rendered) kubeletDir(t *testing.T) string {
	return strings.TrimSuffix(r.str(t, "kubeletDir"), "/")
}

func (r *rendered) stateDir(t *testing.T) string {
	return strings.TrimSuffix(r.str(t, "stateDir"), "/")
}

// builtin says whether the plugin registers itself and serves /healthz.
func (r *rendered) builtin(t *testing.T) bool {
	return r.str(t, "registration") == "builtin"
}

// daemonSets are the node's and the mounter's.
func (r *rendered) daemonSets() []*appsv1.DaemonSet { return []*appsv1.DaemonSet{r.ds, r.mds} }

// containers are every container of both pods.
func (r *rendered) containers() []corev1.Container {
	return append(slices.Clone(r.ds.Spec.Template.Spec.Containers), r.mds.Spec.Template.Spec.Containers...)
}

// hasContainer says whether either pod runs a container of that name.
func (r *rendered) hasContainer(name string) bool {
	return slices.ContainsFunc(r.containers(), func(c corev1.Container) bool { return c.Name == name })
}

// container finds a container of either pod by name.
func (r *rendered) container(t *testing.T, name string) *corev1.Container {
	t.Helper()
	for _, ds := range r.daemonSets() {
		for i := range ds.Spec.Template.Spec.Containers {
			if c := &ds.Spec.Template.Spec.Containers[i]; c.Name == name {
				return c
			}
		}
	}
	t.Fatalf("neither DaemonSet has a container %q", name)
	return nil
}

// podOf is the DaemonSet whose pod holds c (a pointer container returned).
func (r *rendered) podOf(t *testing.T, c *corev1.Container) *appsv1.DaemonSet {
	t.Helper()
	for _, ds := range r.daemonSets() {
		for i := range ds.Spec.Template.Spec.Containers {
			if &ds.Spec.Template.Spec.Containers[i] == c {
				return ds
			}
		}
	}
	t.Fatalf("container %s is in neither DaemonSet", c.Name)
	return nil
}

// volumeOf returns a volume of ds's pod.
func volumeOf(t *testing.T, ds *appsv1.DaemonSet, name string) *corev1.Volume {
	t.Helper()
	for i := range ds.Spec.Template.Spec.Volumes {
		if v := &ds.Spec.Template.Spec.Volumes[i]; v.Name == name {
			return v
		}
	}
	t.Fatalf("DaemonSet %s has no volume %q", ds.Name, name)
	return nil
}

// mountOf returns the container's mount of a volume and that volume.
func (r *rendered) mountOf(t *testing.T, c *corev1.Container, volume string) (*corev1.VolumeMount, *corev1.Volume) {
	t.Helper()
	for i := range c.VolumeMounts {
		if m := &c.VolumeMounts[i]; m.Name == volume {
			return m, volumeOf(t, r.podOf(t, c), volume)
		}
	}
	t.Fatalf("container %s does not mount volume %q", c.Name, volume)
	return nil, nil
}

// mountAt returns the container's mount at mountPath and its volume.
func (r *rendered) mountAt(t *testing.T, c *corev1.Container, mountPath string) (*corev1.VolumeMount, *corev1.Volume) {
	t.Helper()
	for i := range c.VolumeMounts {
		if m := &c.VolumeMounts[i]; m.MountPath == mountPath {
			return m, volumeOf(t, r.podOf(t, c), m.Name)
		}
	}
	t.Fatalf("container %s mounts nothing at %s", c.Name, mountPath)
	return nil, nil
}

// args returns the container's arguments as flag → value ("" for a bare flag).
// A flag given twice fails the test.
func args(t *testing.T, c *corev1.Container) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, a := range c.Args {
		if !strings.HasPrefix(a, "--") {
			continue
		}
		k, v, _ := strings.Cut(a, "=")
		if _, dup := m[k]; dup {
			t.Errorf("container %s: flag %s given twice", c.Name, k)
		}
		m[k] = v
	}
	return m
}

func wantArg(t *testing.T, c *corev1.Container, flag, want string) {
	t.Helper()
	got, ok := args(t, c)[flag]
	if !ok {
		t.Errorf("container %s: no %s flag in %q", c.Name, flag, c.Args)
	} else if got != want {
		t.Errorf("container %s: %s=%q, want %q", c.Name, flag, got, want)
	}
}

// socketPath turns unix:///dir/file into /dir/file.
func socketPath(t *testing.T, endpoint string) string {
	t.Helper()
	p, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || !strings.HasPrefix(p, "/") {
		t.Fatalf("endpoint %q is not unix:///absolute/path", endpoint)
	}
	return p
}

func envFromNodeName(t *testing.T, c *corev1.Container, name string) {
	t.Helper()
	for _, e := range c.Env {
		if e.Name == name {
			if e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName" || e.Value != "" {
				t.Errorf("container %s: env %s is not taken from spec.nodeName: %+v", c.Name, name, e)
			}
			return
		}
	}
	t.Errorf("container %s: no env %s", c.Name, name)
}

func forEachValueSet(t *testing.T, check func(t *testing.T, r *rendered)) {
	for _, vs := range valueSets {
		t.Run(vs.name, func(t *testing.T) {
			check(t, render(t, vs.values))
		})
	}
}

func TestLint(t *testing.T) {
	kv, err := chartutil.ParseKubeVersion(chartrender.KubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	for _, vs := range valueSets {
		t.Run(vs.name, func(t *testing.T) {
			values := vs.values
			if values == nil {
				values = map[string]any{}
			}
			l := lint.AllWithKubeVersion(chartDir, values, chartrender.Namespace, kv)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %v", m)
				} else {
					t.Logf("helm lint: %v", m)
				}
			}
		})
	}
}

func TestObjects(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		clusterScoped := map[string]bool{"CSIDriver": true, "StorageClass": true, "ClusterRole": true, "ClusterRoleBinding": true, "VolumeSnapshotClass": true}
		for _, o := range r.objs {
			switch {
			case clusterScoped[o.kind] && o.namespace != "":
				t.Errorf("%s %s is cluster-scoped but has namespace %q", o.kind, o.name, o.namespace)
			case !clusterScoped[o.kind] && o.namespace != chartrender.Namespace:
				t.Errorf("%s %s: namespace %q, want the release namespace %q", o.kind, o.name, o.namespace, chartrender.Namespace)
			}
		}
		// Every image is pinned to a tag other than latest.
		for _, c := range r.containers() {
			ref := c.Image
			if i := strings.LastIndex(ref, "@"); i >= 0 {
				continue // digest
			}
			i := strings.LastIndex(ref, ":")
			if i < 0 || strings.Contains(ref[i:], "/") || ref[i+1:] == "" || ref[i+1:] == "latest" {
				t.Errorf("container %s: image %q is not pinned to a tag", c.Name, ref)
			}
			if c.ImagePullPolicy == "" {
				t.Errorf("container %s: no imagePullPolicy", c.Name)
			}
			if c.Resources.Requests == nil {
				t.Errorf("container %s: no resource requests", c.Name)
			}
		}
		// CSI sidecars come from kubernetes-csi's registry; the registrar and the
		// livenessprobe run only when the plugin does not do their work.
		sidecars := []string{"csi-provisioner"}
		if r.hasContainer("csi-snapshotter") {
			sidecars = append(sidecars, "csi-snapshotter")
		}
		if !r.builtin(t) {
			sidecars = append(sidecars, "node-driver-registrar", "liveness-probe")
		}
		for _, name := range sidecars {
			if img := r.container(t, name).Image; !strings.HasPrefix(img, "registry.k8s.io/sig-storage/") {
				t.Errorf("container %s: image %q is not from registry.k8s.io/sig-storage", name, img)
			}
		}
		if r.builtin(t) && (r.hasContainer("node-driver-registrar") || r.hasContainer("liveness-probe")) {
			t.Error("registration: builtin still runs the registrar or livenessprobe container")
		}
	})
}

// TestPodWiring checks both pod specs for internal consistency: volumes and
// mounts match up, no two mounts of a container collide, and each DaemonSet
// selects its own pods and no other's.
func TestPodWiring(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		names := map[string]bool{}
		for _, ds := range r.daemonSets() {
			spec := ds.Spec.Template.Spec
			volumes := map[string]bool{}
			for _, v := range spec.Volumes {
				if volumes[v.Name] {
					t.Errorf("%s: volume %s defined twice", ds.Name, v.Name)
				}
				volumes[v.Name] = true
			}
			used := map[string]bool{}
			for _, c := range spec.Containers {
				if names[c.Name] {
					t.Errorf("container %s defined twice", c.Name)
				}
				names[c.Name] = true
				paths := map[string]bool{}
				for _, m := range c.VolumeMounts {
					if !volumes[m.Name] {
						t.Errorf("%s: container %s mounts undefined volume %s", ds.Name, c.Name, m.Name)
					}
					used[m.Name] = true
					if paths[m.MountPath] {
						t.Errorf("container %s mounts twice at %s", c.Name, m.MountPath)
					}
					paths[m.MountPath] = true
					if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional &&
						(c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged) {
						t.Errorf("container %s: Bidirectional mount %s needs a privileged container", c.Name, m.Name)
					}
				}
				for _, p := range c.Ports {
					if len(p.Name) > 15 {
						t.Errorf("container %s: port name %q longer than 15 characters", c.Name, p.Name)
					}
				}
			}
			for v := range volumes {
				if !used[v] {
					t.Errorf("%s: volume %s is not mounted by any container", ds.Name, v)
				}
			}
			// The selector selects its pods, and only its own.
			for k, v := range ds.Spec.Selector.MatchLabels {
				if ds.Spec.Template.Labels[k] != v {
					t.Errorf("%s: selector %s=%s does not match the pod template labels %v", ds.Name, k, v, ds.Spec.Template.Labels)
				}
			}
			for _, other := range r.daemonSets() {
				if other == ds {
					continue
				}
				selects := true
				for k, v := range ds.Spec.Selector.MatchLabels {
					selects = selects && other.Spec.Template.Labels[k] == v
				}
				if selects {
					t.Errorf("%s's selector %v selects %s's pods too", ds.Name, ds.Spec.Selector.MatchLabels, other.Name)
				}
			}
			// The ConfigMap named by the config volume is the rendered one.
			if cmName := volumeOf(t, ds, "config").ConfigMap; cmName == nil || cmName.Name != r.cm.Name {
				t.Errorf("%s: config volume does not refer to ConfigMap %s", ds.Name, r.cm.Name)
			}
		}
		// The ServiceAccount the node pods use is the one bound to the
		// provisioner's role; the mounter talks to no API server.
		sa := r.ds.Spec.Template.Spec.ServiceAccountName
		if r.sa != nil && r.sa.Name != sa {
			t.Errorf("ServiceAccount %s rendered, pods use %s", r.sa.Name, sa)
		}
		if want := r.str(t, "serviceAccount.name"); want != "" && sa != want {
			t.Errorf("pods use ServiceAccount %s, want serviceAccount.name %s", sa, want)
		}
		if m := r.mds.Spec.Template.Spec; m.ServiceAccountName != "" || m.AutomountServiceAccountToken == nil || *m.AutomountServiceAccountToken {
			t.Errorf("the mounter's pod has ServiceAccount %q, automount %v: it needs no token", m.ServiceAccountName, m.AutomountServiceAccountToken)
		}
		if r.binding == nil || r.role == nil {
			t.Fatal("no ClusterRole/ClusterRoleBinding rendered")
		}
		if r.binding.RoleRef.Kind != "ClusterRole" || r.binding.RoleRef.Name != r.role.Name || r.binding.RoleRef.APIGroup != rbacv1.GroupName {
			t.Errorf("ClusterRoleBinding refers to %+v, want ClusterRole %s", r.binding.RoleRef, r.role.Name)
		}
		want := rbacv1.Subject{Kind: "ServiceAccount", Name: sa, Namespace: chartrender.Namespace}
		if !slices.Contains(r.binding.Subjects, want) {
			t.Errorf("ClusterRoleBinding subjects %+v lack %+v", r.binding.Subjects, want)
		}
	})
}

func TestPlugin(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		c := r.container(t, "plugin")
		if !slices.Equal(c.Command, []string{pluginBinary}) {
			t.Errorf("plugin command %q, want %s", c.Command, pluginBinary)
		}
		wantArg(t, c, "--endpoint", csiEndpoint)
		wantArg(t, c, "--node-id", "$(NODE_NAME)")
		envFromNodeName(t, c, "NODE_NAME")
		wantArg(t, c, "--driver-name", r.str(t, "driverName"))
		wantArg(t, c, "--state-dir", r.stateDir(t))
		wantArg(t, c, "--kubelet-dir", r.kubeletDir(t))
		wantArg(t, c, "--config", configPath)
		wantArg(t, c, "--mounter-endpoint", mounterEndpoint)
		wantArg(t, c, "--v", r.str(t, "logVerbosity"))

		// The config file is the ConfigMap's config.yaml.
		m, v := r.mountAt(t, c, filepath.Dir(configPath))
		if v.ConfigMap == nil || !m.ReadOnly {
			t.Errorf("%s is not a read-only ConfigMap mount", filepath.Dir(configPath))
		}
		// The rendered config carries the config values unchanged.
		for _, key := range []string{"imageRoots", "mountPolicy", "defaultFsType"} {
			if got, want := r.rawConfig[key], r.value(t, "config."+key); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("config %s: %v, want %v", key, got, want)
			}
		}
		profiles, _ := r.value(t, "config.fuseProfiles").([]any)
		if got, _ := r.rawConfig["fuseProfiles"].([]any); fmt.Sprint(got) != fmt.Sprint(profiles) {
			t.Errorf("config fuseProfiles %v, want %v", got, profiles)
		}
		if c := r.config; c != nil {
			if fmt.Sprint(c.ImageRoots) != fmt.Sprint(r.value(t, "config.imageRoots")) ||
				c.MountPolicy.AllowSuidDev != (r.value(t, "config.mountPolicy.allowSuidDev") == true) ||
				c.DefaultFsType != r.str(t, "config.defaultFsType") {
				t.Errorf("the plugin reads %+v from the rendered config", *c)
			}
		}

		// The state dir is the host's, at the same path (plans carry host
		// paths): the plugin writes the journal and the images there, and
		// sees the chain and FUSE mounts the mounter makes under it.
		// HostToContainer: it makes no mount. kubelet's pods and CSI dirs
		// it does not see (TestPluginSeesNoKubeletFiles).
		checkHostMount(t, r, c, "state-dir", r.stateDir(t), corev1.MountPropagationHostToContainer)

		// The CSI socket lives in <kubeletDir>/plugins/<driverName>, mounted at its directory.
		sock := socketPath(t, csiEndpoint)
		_, sv := r.mountAt(t, c, filepath.Dir(sock))
		if sv.HostPath == nil || sv.HostPath.Path != r.kubeletDir(t)+"/plugins/"+r.str(t, "driverName") {
			t.Errorf("CSI socket dir volume %+v, want hostPath %s/plugins/%s", sv.VolumeSource, r.kubeletDir(t), r.str(t, "driverName"))
		}
		// The mounter's socket: its hostPath, read-only (connect works on it).
		mm, mv := r.mountAt(t, c, filepath.Dir(socketPath(t, mounterEndpoint)))
		if mv.HostPath == nil || mv.HostPath.Path != r.mounterSocketDir(t) || !mm.ReadOnly {
			t.Errorf("mounter socket dir %s: %+v (read-only %v), want hostPath %s read-only", mm.Name, mv.VolumeSource, mm.ReadOnly, r.mounterSocketDir(t))
		}

		// Liveness: kubelet probes /healthz on healthPort, served by the livenessprobe container.
		healthPort := r.num(t, "healthPort")
		lp := c.LivenessProbe
		if lp == nil || lp.HTTPGet == nil || lp.HTTPGet.Path != "/healthz" {
			t.Fatalf("plugin has no httpGet /healthz liveness probe: %+v", lp)
		}
		port := lp.HTTPGet.Port.IntValue()
		if lp.HTTPGet.Port.StrVal != "" {
			port = 0
			for _, p := range c.Ports {
				if p.Name == lp.HTTPGet.Port.StrVal {
					port = int(p.ContainerPort)
				}
			}
		}
		if int32(port) != healthPort {
			t.Errorf("liveness probe port %v resolves to %d, want healthPort %d", lp.HTTPGet.Port, port, healthPort)
		}
		// Who serves it: the plugin itself, or the livenessprobe container
		// calling Probe on the same socket.
		var ep string
		if r.builtin(t) {
			ep = args(t, c)["--health-address"]
		} else {
			probe := r.container(t, "liveness-probe")
			wantArg(t, probe, "--csi-address", sock)
			r.mountAt(t, probe, filepath.Dir(sock))
			ep = args(t, probe)["--http-endpoint"]
			if _, ok := args(t, c)["--health-address"]; ok {
				t.Error("the plugin serves /healthz next to the livenessprobe container")
			}
		}
		if !strings.HasSuffix(ep, ":"+strconv.Itoa(int(healthPort))) {
			t.Errorf("health endpoint %q does not listen on healthPort %d", ep, healthPort)
		}
		hostNetwork := r.value(t, "hostNetwork") == true
		if r.ds.Spec.Template.Spec.HostNetwork != hostNetwork {
			t.Errorf("hostNetwork %v, want %v", r.ds.Spec.Template.Spec.HostNetwork, hostNetwork)
		}
		if hostNetwork {
			if ep != "localhost:"+strconv.Itoa(int(healthPort)) || lp.HTTPGet.Host != "localhost" {
				t.Errorf("with hostNetwork the health endpoint must stay on localhost: %q, probe host %q", ep, lp.HTTPGet.Host)
			}
			if r.ds.Spec.Template.Spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
				t.Errorf("dnsPolicy %q with hostNetwork", r.ds.Spec.Template.Spec.DNSPolicy)
			}
		} else if lp.HTTPGet.Host != "" {
			t.Errorf("without hostNetwork the probe must target the pod IP, not %q", lp.HTTPGet.Host)
		}

		// Metrics: only when enabled.
		metricsArg, hasMetrics := args(t, c)["--metrics-address"]
		if r.value(t, "metrics.enabled") == true {
			want := ":" + r.str(t, "metrics.port")
			if metricsArg != want {
				t.Errorf("--metrics-address=%q, want %q", metricsArg, want)
			}
			found := false
			for _, p := range c.Ports {
				found = found || (p.Name == "metrics" && strconv.Itoa(int(p.ContainerPort)) == r.str(t, "metrics.port"))
			}
			if !found {
				t.Errorf("no metrics container port %s", r.str(t, "metrics.port"))
			}
		} else if hasMetrics || strings.Contains(r.text, "--metrics-address") {
			t.Error("--metrics-address rendered with metrics.enabled false")
		}
	})
}

func checkHostMount(t *testing.T, r *rendered, c *corev1.Container, volume, hostPath string, propagation corev1.MountPropagationMode) {
	t.Helper()
	m, v := r.mountOf(t, c, volume)
	if v.HostPath == nil || v.HostPath.Path != hostPath {
		t.Errorf("volume %s: %+v, want hostPath %s", volume, v.VolumeSource, hostPath)
	}
	if m.MountPath != hostPath {
		t.Errorf("container %s: volume %s mounted at %s, want the host path %s", c.Name, volume, m.MountPath, hostPath)
	}
	var got corev1.MountPropagationMode
	if m.MountPropagation != nil {
		got = *m.MountPropagation
	}
	if propagation != "" && got != propagation {
		t.Errorf("container %s: volume %s propagation %q, want %q", c.Name, volume, got, propagation)
	}
}

// mounterSocketDir is the host directory of the mounter's socket.
func (r *rendered) mounterSocketDir(t *testing.T) string {
	if d := strings.TrimSuffix(r.str(t, "mounter.socketDir"), "/"); d != "" {
		return d
	}
	return r.kubeletDir(t) + "/plugins/" + r.str(t, "driverName") + "-mounter"
}

// recordsDir is the host directory of the mounter's own records.
func (r *rendered) recordsDir(t *testing.T) string {
	if d := strings.TrimSuffix(r.str(t, "mounter.recordsDir"), "/"); d != "" {
		return d
	}
	return r.stateDir(t) + "-mounter"
}

// TestMounter: the mounter runs alone in a pod of its own that holds what
// every privileged act needs: privileged, the host's PID and network
// namespaces, /dev, the state dir and kubelet's dirs Bidirectional, its
// socket's directory (shared with the plugin only) and its records (shared
// with nobody).
func TestMounter(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		c := r.container(t, "mounter")
		spec := r.mds.Spec.Template.Spec
		if r.podOf(t, c) != r.mds || len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
			t.Errorf("the mounter's pod runs %d containers (%d init), want the mounter alone", len(spec.Containers), len(spec.InitContainers))
		}
		if !spec.HostPID {
			t.Error("the mounter's pod does not have hostPID: it cannot reach consumers' mount namespaces")
		}
		if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
			t.Errorf("the mounter's pod: hostNetwork %v, dnsPolicy %s: iscsiadm and the nbd netlink family need the host's network", spec.HostNetwork, spec.DNSPolicy)
		}
		if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
			t.Error("mounter is not privileged")
		}
		if !slices.Equal(c.Command, []string{sidecarBinary}) || len(c.Args) == 0 || c.Args[0] != "serve" {
			t.Errorf("mounter runs %q %q, want %s serve", c.Command, c.Args, sidecarBinary)
		}
		wantArg(t, c, "--endpoint", mounterEndpoint)
		wantArg(t, c, "--state-dir", r.stateDir(t))
		wantArg(t, c, "--records-dir", r.recordsDir(t))
		wantArg(t, c, "--kubelet-dir", r.kubeletDir(t))
		// Its socket's directory: the hostPath the plugin mounts too.
		sock := filepath.Dir(socketPath(t, mounterEndpoint))
		_, v := r.mountAt(t, c, sock)
		_, pv := r.mountAt(t, r.container(t, "plugin"), sock)
		if v.HostPath == nil || pv.HostPath == nil || v.HostPath.Path != r.mounterSocketDir(t) || pv.HostPath.Path != v.HostPath.Path {
			t.Errorf("mounter and plugin do not share the hostPath %s of the mounter's socket (%+v, %+v)", r.mounterSocketDir(t), v.VolumeSource, pv.VolumeSource)
		}
		checkHostMount(t, r, c, "records-dir", r.recordsDir(t), "")
		checkHostMount(t, r, c, "pods-dir", r.kubeletDir(t)+"/pods", corev1.MountPropagationBidirectional)
		checkHostMount(t, r, c, "kubelet-csi-dir", r.kubeletDir(t)+"/plugins/kubernetes.io/csi", corev1.MountPropagationBidirectional)
		// Chains, FUSE daemons and the guard mount under the state dir: the
		// mounts must reach the host and the plugin.
		checkHostMount(t, r, c, "state-dir", r.stateDir(t), corev1.MountPropagationBidirectional)
		checkHostMount(t, r, c, "dev", "/dev", "")
		// The policy is the plugin's config: the same file.
		wantArg(t, c, "--config", configPath)
		m, cv := r.mountAt(t, c, filepath.Dir(configPath))
		if cv.ConfigMap == nil || !m.ReadOnly || cv.ConfigMap.Name != r.cm.Name {
			t.Errorf("%s in the mounter is not the plugin's read-only ConfigMap", filepath.Dir(configPath))
		}
		// The daemons live in the mounter's cgroup: an OOM kill must not
		// take their mounts down.
		if _, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
			t.Errorf("the mounter has a memory limit (%v): the FUSE daemons run in its cgroup", c.Resources.Limits.Memory())
		}
		// Its records are its alone: no container of the node pod mounts the
		// records dir or anything around it.
		for _, nc := range r.ds.Spec.Template.Spec.Containers {
			for _, nm := range nc.VolumeMounts {
				hv := volumeOf(t, r.ds, nm.Name).HostPath
				if hv != nil && (plan.Within(hv.Path, r.recordsDir(t)) || plan.Within(r.recordsDir(t), hv.Path)) {
					t.Errorf("container %s mounts %s (host %s), which holds or lies in the mounter's records %s", nc.Name, nm.MountPath, hv.Path, r.recordsDir(t))
				}
			}
		}
		// Both DaemonSets are scheduled alike: a node with the plugin has the mounter.
		n, md := r.ds.Spec.Template.Spec, spec
		if !reflect.DeepEqual(n.Tolerations, md.Tolerations) || !reflect.DeepEqual(n.NodeSelector, md.NodeSelector) ||
			!reflect.DeepEqual(n.Affinity, md.Affinity) || n.PriorityClassName != md.PriorityClassName ||
			!reflect.DeepEqual(r.ds.Spec.UpdateStrategy, r.mds.Spec.UpdateStrategy) {
			t.Errorf("the node and the mounter DaemonSets are scheduled differently")
		}
	})
}

func TestRegistrar(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		plugin := r.container(t, "plugin")
		pluginSock := socketPath(t, args(t, plugin)["--endpoint"])
		pluginDir := r.kubeletDir(t) + "/plugins/" + r.str(t, "driverName")
		// kubelet finds the plugin's socket on the host, in <kubeletDir>/plugins/<driverName>.
		_, sv := r.mountAt(t, plugin, filepath.Dir(pluginSock))
		if sv.HostPath == nil || sv.HostPath.Path != pluginDir {
			t.Errorf("socket volume %+v, want hostPath %s", sv.VolumeSource, pluginDir)
		}
		var c *corev1.Container // who registers: never the plugin (TestRegistrationDirOnlyInTheRegistrar)
		if r.builtin(t) {
			// The registration socket lies in kubelet's plugins_registry and
			// is named after the driver (kubelet watches the directory).
			c = r.container(t, "mounter")
			reg := args(t, c)["--registration-socket"]
			if reg != "/registration/"+r.str(t, "driverName")+"-reg.sock" {
				t.Errorf("mounter --registration-socket=%q, want /registration/<driverName>-reg.sock", reg)
			}
		} else {
			c = r.container(t, "node-driver-registrar")
			wantArg(t, c, "--csi-address", pluginSock)
			// The socket the registrar dials is the plugin's: same volume at the same path.
			rm, _ := r.mountAt(t, c, filepath.Dir(pluginSock))
			pm, _ := r.mountAt(t, plugin, filepath.Dir(pluginSock))
			if rm.Name != pm.Name {
				t.Errorf("registrar mounts %s at %s, plugin mounts %s", rm.Name, rm.MountPath, pm.Name)
			}
			if _, ok := args(t, plugin)["--registration-socket"]; ok {
				t.Error("the plugin registers itself next to node-driver-registrar")
			}
		}
		wantArg(t, c, "--kubelet-registration-path", pluginDir+"/"+filepath.Base(pluginSock))
		_, regv := r.mountAt(t, c, "/registration")
		if regv.HostPath == nil || regv.HostPath.Path != r.kubeletDir(t)+"/plugins_registry" {
			t.Errorf("registration volume %+v, want hostPath %s/plugins_registry", regv.VolumeSource, r.kubeletDir(t))
		}
	})
}

// TestAdminRoots: every host directory the config lets volumes name is in
// the containers that read it, at its host path (item 1 of the cluster issue:
// a static PV's image under imageRoots was NotFound inside the plugin).
func TestAdminRoots(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		stateDir := r.stateDir(t)
		visible := func(c *corev1.Container, root string) {
			t.Helper()
			if root == stateDir || strings.HasPrefix(root, stateDir+"/") {
				r.mountAt(t, c, stateDir) // inside the state dir, mounted already
				return
			}
			m, v := r.mountAt(t, c, root)
			if v.HostPath == nil || v.HostPath.Path != root || v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectory {
				t.Errorf("container %s: %s is %+v, want hostPath %s of type Directory", c.Name, root, v.VolumeSource, root)
			}
			if m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
				t.Errorf("container %s: %s propagation %v, want HostToContainer (mounts made later on the host must show)", c.Name, root, m.MountPropagation)
			}
			// The plugin writes no admin root: it reads images and
			// sources and connects to sockets (connect works read-only).
			if c.Name == "plugin" && !m.ReadOnly {
				t.Errorf("plugin: admin root %s is writable", root)
			}
		}
		plugin, mounter := r.container(t, "plugin"), r.container(t, "mounter")
		fuseRoots := map[string]bool{}
		for _, p := range r.config.FuseProfiles {
			for _, root := range p.Source.Roots {
				visible(plugin, root)  // checks the source
				visible(mounter, root) // the daemon reads and writes it
				fuseRoots[root] = true
			}
		}
		for _, root := range r.config.ImageRoots {
			visible(plugin, root) // checks a static volume's image
			// The mounter opens the image below the root and attaches it,
			// read-write for a writable volume.
			visible(mounter, root)
			if root == stateDir || strings.HasPrefix(root, stateDir+"/") {
				continue
			}
			if m, _ := r.mountAt(t, mounter, root); m.ReadOnly {
				t.Errorf("mounter: image root %s is read-only: a writable static volume cannot be attached", root)
			}
		}
		// NBD sockets: the plugin connects to them and hands the mounter the
		// connected socket; the mounter has no business there.
		for _, root := range r.config.NBD.SocketRoots {
			visible(plugin, root)
			if fuseRoots[root] || slices.Contains(r.config.ImageRoots, root) || plan.Within(stateDir, root) {
				continue
			}
			for _, m := range mounter.VolumeMounts {
				if m.MountPath == root {
					t.Errorf("mounter mounts NBD socket root %s", root)
				}
			}
		}
	})
}

// TestResizer: the StorageClass promises expansion only with the node-local
// resizer deployed, and the resizer has what it needs.
func TestResizer(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		enabled := r.value(t, "resizer.enabled") == true
		if r.sc != nil && (r.sc.AllowVolumeExpansion == nil || *r.sc.AllowVolumeExpansion != enabled) {
			t.Errorf("StorageClass allowVolumeExpansion %v with resizer.enabled %v", r.sc.AllowVolumeExpansion, enabled)
		}
		if allows(r.role, "", "persistentvolumeclaims/status", "patch") != enabled {
			t.Errorf("ClusterRole allows patching claim status: %v, want %v (resizer.enabled)", !enabled, enabled)
		}
		if !enabled {
			if r.hasContainer("resizer") {
				t.Error("resizer container with resizer.enabled false")
			}
			return
		}
		c := r.container(t, "resizer")
		if !slices.Equal(c.Command, []string{resizerBinary}) || c.Image != r.container(t, "plugin").Image {
			t.Errorf("resizer runs %q from %s, want %s from the plugin's image", c.Command, c.Image, resizerBinary)
		}
		wantArg(t, c, "--plugin-endpoint", csiEndpoint)
		r.mountAt(t, c, filepath.Dir(socketPath(t, csiEndpoint)))
		wantArg(t, c, "--node-id", "$(NODE_NAME)")
		envFromNodeName(t, c, "NODE_NAME")
		wantArg(t, c, "--driver-name", r.str(t, "driverName"))
		if c.SecurityContext == nil || c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged {
			t.Error("the resizer needs no privilege")
		}
		for _, verb := range []string{"get", "list", "watch", "patch"} {
			if !allows(r.role, "", "persistentvolumes", verb) {
				t.Errorf("ClusterRole does not allow %s persistentvolumes", verb)
			}
		}
	})
}

func TestProvisioner(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		c := r.container(t, "csi-provisioner")
		sock := socketPath(t, csiEndpoint)
		wantArg(t, c, "--csi-address", sock)
		r.mountAt(t, c, filepath.Dir(sock))
		for _, f := range []string{"--node-deployment", "--strict-topology", "--extra-create-metadata"} {
			wantArg(t, c, f, "")
		}
		wantArg(t, c, "--immediate-topology", "false")
		wantArg(t, c, "--timeout", fmt.Sprint(r.value(t, "provisioner.timeout")))
		// Topology is GA: setting its gate only logs a removal warning.
		if _, ok := args(t, c)["--feature-gates"]; ok {
			t.Errorf("provisioner --feature-gates=%s", args(t, c)["--feature-gates"])
		}
		envFromNodeName(t, c, "NODE_NAME")

		// RBAC as external-provisioner documents it.
		need := []struct {
			group, resource string
			verbs           []string
		}{
			{"", "persistentvolumes", []string{"get", "list", "watch", "create", "patch", "delete"}},
			{"", "persistentvolumeclaims", []string{"get", "list", "watch", "update"}},
			{"storage.k8s.io", "storageclasses", []string{"get", "list", "watch"}},
			{"", "events", []string{"list", "watch", "create", "update", "patch"}},
			{"storage.k8s.io", "csinodes", []string{"get", "list", "watch"}},
			{"", "nodes", []string{"get", "list", "watch"}},
			{"storage.k8s.io", "volumeattachments", []string{"get", "list", "watch"}},
		}
		for _, n := range need {
			for _, verb := range n.verbs {
				if !allows(r.role, n.group, n.resource, verb) {
					t.Errorf("ClusterRole %s does not allow %s %s.%s", r.role.Name, verb, n.resource, n.group)
				}
			}
		}
		for _, rule := range r.role.Rules {
			for _, s := range append(append(rule.Verbs, rule.Resources...), rule.APIGroups...) {
				if s == "*" {
					t.Errorf("ClusterRole %s has a wildcard rule %+v", r.role.Name, rule)
				}
			}
			if slices.Contains(rule.Resources, "secrets") {
				t.Errorf("ClusterRole %s grants access to secrets", r.role.Name)
			}
		}
	})
}

func allows(role *rbacv1.ClusterRole, group, resource, verb string) bool {
	for _, r := range role.Rules {
		if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
			return true
		}
	}
	return false
}

func TestCSIDriver(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		d := r.driver
		if d.Name != r.str(t, "driverName") {
			t.Errorf("CSIDriver name %q, want driverName %q", d.Name, r.str(t, "driverName"))
		}
		if d.Spec.AttachRequired == nil || *d.Spec.AttachRequired {
			t.Error("CSIDriver attachRequired is not false")
		}
		if d.Spec.PodInfoOnMount == nil || !*d.Spec.PodInfoOnMount {
			t.Error("CSIDriver podInfoOnMount is not true")
		}
		modes := []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent, storagev1.VolumeLifecycleEphemeral}
		if !slices.Equal(d.Spec.VolumeLifecycleModes, modes) {
			t.Errorf("CSIDriver volumeLifecycleModes %v, want %v", d.Spec.VolumeLifecycleModes, modes)
		}
		if d.Spec.FSGroupPolicy == nil || *d.Spec.FSGroupPolicy != storagev1.FileFSGroupPolicy {
			t.Errorf("CSIDriver fsGroupPolicy %v, want File", d.Spec.FSGroupPolicy)
		}
		// SELinuxMount: kubelet sends the pod's label as context= only
		// when the CSIDriver says so; on unless the values turn it off.
		want := r.value(t, "csiDriver.seLinuxMount") == true
		if d.Spec.SELinuxMount == nil || *d.Spec.SELinuxMount != want {
			t.Errorf("CSIDriver seLinuxMount %v, want %t", ptrString(d.Spec.SELinuxMount), want)
		}
	})
}

func ptrString(b *bool) string {
	if b == nil {
		return "unset"
	}
	return fmt.Sprint(*b)
}

func TestStorageClass(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		if r.value(t, "storageClass.create") != true {
			if r.sc != nil {
				t.Errorf("StorageClass %s rendered with storageClass.create false", r.sc.Name)
			}
			return
		}
		sc := r.sc
		if sc == nil {
			t.Fatal("no StorageClass rendered")
		}
		if sc.Name != r.str(t, "storageClass.name") || sc.Provisioner != r.str(t, "driverName") {
			t.Errorf("StorageClass %s provisioner %s", sc.Name, sc.Provisioner)
		}
		if sc.Parameters["type"] != "loop" || sc.Parameters["csi.storage.k8s.io/fstype"] != r.str(t, "storageClass.fsType") {
			t.Errorf("StorageClass parameters %v", sc.Parameters)
		}
		if sc.VolumeBindingMode == nil || *sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
			t.Errorf("StorageClass volumeBindingMode %v, want WaitForFirstConsumer", sc.VolumeBindingMode)
		}
		if sc.ReclaimPolicy == nil || string(*sc.ReclaimPolicy) != r.str(t, "storageClass.reclaimPolicy") {
			t.Errorf("StorageClass reclaimPolicy %v", sc.ReclaimPolicy)
		}
		isDefault := sc.Annotations["storageclass.kubernetes.io/is-default-class"] == "true"
		if isDefault != (r.value(t, "storageClass.isDefault") == true) {
			t.Errorf("StorageClass default annotation %v, want storageClass.isDefault", sc.Annotations)
		}
	})
}

func TestDaemonSetScheduling(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		for _, ds := range r.daemonSets() {
			spec := ds.Spec.Template.Spec
			var want []corev1.Toleration
			b, _ := yaml.Marshal(r.value(t, "tolerations"))
			if err := yaml.UnmarshalStrict(b, &want); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(spec.Tolerations, want) {
				t.Errorf("%s: tolerations %+v, want %+v", ds.Name, spec.Tolerations, want)
			}
			if spec.PriorityClassName != r.str(t, "priorityClassName") {
				t.Errorf("%s: priorityClassName %q", ds.Name, spec.PriorityClassName)
			}
			if got := spec.NodeSelector["kubernetes.io/os"]; got != "linux" {
				t.Errorf("%s: nodeSelector %v lacks kubernetes.io/os: linux", ds.Name, spec.NodeSelector)
			}
			if !slices.Equal(spec.ImagePullSecrets, r.ds.Spec.Template.Spec.ImagePullSecrets) {
				t.Errorf("%s: imagePullSecrets %v", ds.Name, spec.ImagePullSecrets)
			}
			u := ds.Spec.UpdateStrategy
			if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil ||
				u.RollingUpdate.MaxUnavailable == nil || u.RollingUpdate.MaxUnavailable.IntValue() != 1 {
				t.Errorf("%s: updateStrategy %+v, want RollingUpdate maxUnavailable 1", ds.Name, u)
			}
		}
	})
}

// TestDefaultScheduling pins the defaults operators rely on.
func TestDefaultScheduling(t *testing.T) {
	r := render(t, nil)
	for _, ds := range r.daemonSets() {
		spec := ds.Spec.Template.Spec
		if len(spec.Tolerations) != 1 || spec.Tolerations[0] != (corev1.Toleration{Operator: corev1.TolerationOpExists}) {
			t.Errorf("%s: default tolerations %+v, want one {operator: Exists}", ds.Name, spec.Tolerations)
		}
		if spec.PriorityClassName != "system-node-critical" {
			t.Errorf("%s: default priorityClassName %q", ds.Name, spec.PriorityClassName)
		}
	}
	if r.str(t, "kubeletDir") != defaultKubeletDir || r.str(t, "driverName") != defaultDriverName ||
		r.str(t, "stateDir") != defaultStateDir || r.num(t, "healthPort") != defaultHealthPort {
		t.Errorf("values.yaml defaults changed: update this test and the README")
	}
	if r.value(t, "metrics.enabled") != false {
		t.Error("metrics are enabled by default")
	}
	if r.sc == nil || r.sc.Name != "mountplan-loop" {
		t.Error("no default StorageClass mountplan-loop")
	}
}

// TestPathValuesPropagate checks that kubeletDir, driverName and stateDir reach
// every path and argument that depends on them, and nothing else: rendering
// with another value equals the default render with the old value replaced.
func TestPathValuesPropagate(t *testing.T) {
	def := render(t, nil)
	for _, tc := range []struct {
		key, old, new string
	}{
		{"kubeletDir", defaultKubeletDir, "/var/lib/k0s/kubelet"},
		{"kubeletDir", defaultKubeletDir, "/opt/kubelet-data"},
		{"driverName", defaultDriverName, "loop.storage.example.com"},
		{"stateDir", defaultStateDir, "/srv/mountplan-state"},
	} {
		t.Run(tc.key+"="+tc.new, func(t *testing.T) {
			r := render(t, map[string]any{tc.key: tc.new})
			if strings.Contains(r.text, tc.old) {
				for _, l := range strings.Split(r.text, "\n") {
					if strings.Contains(l, tc.old) {
						t.Errorf("%s=%s still renders %s: %s", tc.key, tc.new, tc.old, strings.TrimSpace(l))
					}
				}
			}
			if want := strings.ReplaceAll(def.text, tc.old, tc.new); r.text != want {
				t.Errorf("%s=%s: render differs from the default render with %s replaced:\n%s", tc.key, tc.new, tc.old, lineDiff(want, r.text))
			}
		})
	}
}

func TestInvalidValues(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
	}{
		{"relative kubeletDir", map[string]any{"kubeletDir": "var/lib/kubelet"}},
		{"empty kubeletDir", map[string]any{"kubeletDir": ""}},
		{"relative stateDir", map[string]any{"stateDir": "mountplan"}},
		{"driverName with a slash", map[string]any{"driverName": "a/b"}},
		{"driverName upper case", map[string]any{"driverName": "Mountplan.CSI.io"}},
		{"empty driverName", map[string]any{"driverName": ""}},
		{"unknown registration", map[string]any{"registration": "both"}},
		{"seLinuxMount not a boolean", map[string]any{"csiDriver": map[string]any{"seLinuxMount": "yes"}}},
		{"relative imageRoot", map[string]any{"config": map[string]any{"imageRoots": []any{"srv/images"}}}},
		{"unclean imageRoot", map[string]any{"config": map[string]any{"imageRoots": []any{"/srv/images/"}}}},
		{"imageRoot /", map[string]any{"config": map[string]any{"imageRoots": []any{"/"}}}},
		{"relative FUSE root", map[string]any{"config": map[string]any{"fuseProfiles": []any{
			map[string]any{"name": "x", "binary": "/bin/x", "args": []any{"{mountpoint}"}, "source": map[string]any{"roots": []any{"srv"}}}}}}},
		// The mounter's records: never where the plugin's container sees them.
		{"recordsDir in the state dir", map[string]any{"mounter": map[string]any{"recordsDir": "/var/lib/mountplan/mounter"}}},
		{"recordsDir is the state dir", map[string]any{"mounter": map[string]any{"recordsDir": "/var/lib/mountplan"}}},
		{"recordsDir holds the state dir", map[string]any{"mounter": map[string]any{"recordsDir": "/var/lib"}}},
		{"recordsDir under kubeletDir", map[string]any{"mounter": map[string]any{"recordsDir": "/var/lib/kubelet/mountplan-mounter"}}},
		{"recordsDir in an image root", map[string]any{"mounter": map[string]any{"recordsDir": "/srv/images/records"},
			"config": map[string]any{"imageRoots": []any{"/srv/images"}}}},
		{"recordsDir is the socket dir", map[string]any{"mounter": map[string]any{"recordsDir": "/run/mountplan", "socketDir": "/run/mountplan"}}},
		{"relative recordsDir", map[string]any{"mounter": map[string]any{"recordsDir": "mounter"}}},
		// The mounter's socket: never where other containers, or the plugin
		// with write access, see it.
		{"socketDir in the state dir", map[string]any{"mounter": map[string]any{"socketDir": "/var/lib/mountplan/sock"}}},
		{"socketDir is the plugin's socket dir", map[string]any{"mounter": map[string]any{"socketDir": "/var/lib/kubelet/plugins/mountplan.csi.io"}}},
		{"socketDir in kubelet's pods dir", map[string]any{"mounter": map[string]any{"socketDir": "/var/lib/kubelet/pods/mounter"}}},
		{"socketDir holds kubelet's dirs", map[string]any{"mounter": map[string]any{"socketDir": "/var/lib/kubelet"}}},
		{"relative socketDir", map[string]any{"mounter": map[string]any{"socketDir": "run/mountplan"}}},
		{"provisioner.timeout without a unit", map[string]any{"provisioner": map[string]any{"timeout": 60}}},
		{"provisioner.timeout zero", map[string]any{"provisioner": map[string]any{"timeout": "0s"}}},
		{"provisioner.timeout with a flag", map[string]any{"provisioner": map[string]any{"timeout": "60s --v=9"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := chartrender.Render(chartDir, tc.values); err == nil {
				t.Errorf("values %v rendered without error", tc.values)
			}
		})
	}
}

// TestDeployUpToDate checks deploy/ against a fresh render (hack/update-deploy.sh).
func TestDeployUpToDate(t *testing.T) {
	want, err := chartrender.DeployFiles(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]byte{}
	files, err := filepath.Glob(filepath.Join(deployDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		got[filepath.Base(f)] = b
	}
	var names []string
	for n := range want {
		names = append(names, n)
	}
	for n := range got {
		if _, ok := want[n]; !ok {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		w, inWant := want[n]
		g, inGot := got[n]
		switch {
		case !inGot:
			t.Errorf("deploy/%s is missing: run hack/update-deploy.sh", n)
		case !inWant:
			t.Errorf("deploy/%s is not rendered from the chart: run hack/update-deploy.sh", n)
		case string(w) != string(g):
			t.Errorf("deploy/%s is out of date: run hack/update-deploy.sh\n%s", n, lineDiff(string(w), string(g)))
		}
	}
	// deploy/ decodes strictly like the chart render does.
	r := &rendered{}
	for _, n := range names {
		for _, doc := range chartrender.Documents(string(got[n])) {
			r.decode(t, "deploy/"+n, doc)
		}
	}
}

// lineDiff shows the first differing lines of two texts.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	shown := 0
	for i := 0; i < max(len(w), len(g)) && shown < 10; i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			fmt.Fprintf(&b, "line %d:\n  want %q\n  got  %q\n", i+1, wl, gl)
			shown++
		}
	}
	return b.String()
}

// TestNodePodUnprivileged: nothing of the node pod (the plugin and the
// kubernetes-csi sidecars) holds a privilege: not privileged, no capability
// (every one dropped, none added), no escalation, a read-only root, the
// node's PID and IPC namespaces not shared, no Bidirectional mount, no host
// /dev, /sys or /proc. The plugin runs as root, only for the files it owns.
func TestNodePodUnprivileged(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		spec := r.ds.Spec.Template.Spec
		if spec.HostPID || spec.HostIPC {
			t.Errorf("node pod: hostPID %v, hostIPC %v", spec.HostPID, spec.HostIPC)
		}
		if sc := spec.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("node pod: no RuntimeDefault seccomp profile: %+v", sc)
		}
		for _, v := range spec.Volumes {
			if hp := v.HostPath; hp != nil {
				for _, kernel := range []string{"/", "/dev", "/sys", "/proc"} {
					if plan.Within(kernel, hp.Path) && (kernel != "/" || hp.Path == "/") {
						t.Errorf("node pod: volume %s is the host's %s", v.Name, hp.Path)
					}
				}
			}
		}
		if len(spec.InitContainers) != 0 || len(spec.EphemeralContainers) != 0 {
			t.Errorf("node pod has init or ephemeral containers")
		}
		for _, c := range spec.Containers {
			sc := c.SecurityContext
			if sc == nil {
				t.Errorf("container %s: no securityContext", c.Name)
				continue
			}
			if sc.Privileged != nil && *sc.Privileged {
				t.Errorf("container %s is privileged", c.Name)
			}
			if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("container %s may escalate its privileges", c.Name)
			}
			if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
				t.Errorf("container %s: capabilities %+v, want drop [ALL] and no add", c.Name, sc.Capabilities)
			}
			if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("container %s has a writable root filesystem", c.Name)
			}
			if sc.ProcMount != nil && *sc.ProcMount != corev1.DefaultProcMount {
				t.Errorf("container %s: procMount %s", c.Name, *sc.ProcMount)
			}
			for _, m := range c.VolumeMounts {
				if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
					t.Errorf("container %s: %s mounted Bidirectional", c.Name, m.MountPath)
				}
			}
		}
		// The ServiceAccount's token only where the API server is called.
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Error("node pod: the ServiceAccount token is mounted into every container")
		}
		const tokenDir = "/var/run/secrets/kubernetes.io/serviceaccount"
		for _, c := range spec.Containers {
			needs := slices.Contains([]string{"csi-provisioner", "csi-snapshotter", "resizer"}, c.Name)
			i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == tokenDir })
			switch {
			case needs && i < 0:
				t.Errorf("container %s calls the API server without a token at %s", c.Name, tokenDir)
			case needs:
				v := volumeOf(t, r.ds, c.VolumeMounts[i].Name)
				if v.Projected == nil || !c.VolumeMounts[i].ReadOnly || !slices.ContainsFunc(v.Projected.Sources, func(p corev1.VolumeProjection) bool { return p.ServiceAccountToken != nil }) {
					t.Errorf("container %s: %s is %+v, want a read-only projected ServiceAccount token", c.Name, tokenDir, v.VolumeSource)
				}
			case i >= 0:
				t.Errorf("container %s has the ServiceAccount token: it does not call the API server", c.Name)
			}
		}
		p := r.container(t, "plugin").SecurityContext
		if p.Privileged == nil || *p.Privileged {
			t.Errorf("plugin: privileged %v, want false said explicitly", p.Privileged)
		}
		if p.RunAsUser == nil || *p.RunAsUser != 0 {
			t.Errorf("plugin: runAsUser %v, want 0 (it owns the state dir's files)", p.RunAsUser)
		}
		if p.RunAsGroup == nil || *p.RunAsGroup != 0 {
			t.Errorf("plugin: runAsGroup %v, want 0 (the state dir is the mounter's uid's, writable by group 0)", p.RunAsGroup)
		}
	})
}
