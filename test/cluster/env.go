//go:build clustertest

package cluster

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// env is what the flows share: the cluster, the chart's values and the
// objects' builders.
type env struct {
	c          *Cluster
	repo, tag  string
	chart      string
	imageRepo  string
	driverName string
	rollout    int               // bumped by each rolling update
	shared     map[string]string // what one flow wrote for a later one to find
}

const (
	busyboxImage = "mountplan.local/busybox:test" // hack/cluster/images
	driverName   = "mountplan.csi.io"
	storageClass = "mountplan-loop"
	imageRepo    = "ghcr.io/mountplan/mountplan" // the chart's default repository; the tag is the test's
)

func newEnv(t *testing.T, c *Cluster, repo, tag string) *env {
	for _, d := range []string{"srv/images", "srv/fuse/rclone"} {
		if err := os.MkdirAll(c.cfg.path(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return &env{c: c, repo: repo, tag: tag, chart: filepath.Join(repo, "charts", "mountplan"), imageRepo: imageRepo, driverName: driverName, shared: map[string]string{}}
}

// values are the chart values of the test: chart values only, no edited
// manifests. kubeletDir and stateDir are the cluster's own (not the
// defaults: kubelet runs with --root-dir under the cluster's directory);
// the mounter's socket and records directories follow them by default
// (<kubeletDir>/plugins/<driverName>-mounter, <stateDir>-mounter), and the
// node pod runs in the pod network (hostNetwork's default, false).
func (e *env) values() string {
	r := e.c.cfg.path
	return fmt.Sprintf(`kubeletDir: %[1]s
stateDir: %[2]s
logVerbosity: 4
registration: builtin
nri: {enabled: true}
snapshots: {enabled: true}
metrics: {enabled: true, port: %[8]d}
podAnnotations: {mountplan.io/rollout: "%[7]d"}
image:
  plugin: {repository: %[3]s, tag: %[4]s, pullPolicy: Never}
  mounter: {repository: %[3]s, tag: %[4]s, pullPolicy: Never}
  provisioner: {pullPolicy: Never}
  snapshotter: {pullPolicy: Never}
config:
  imageRoots: [%[5]s]
  fuseProfiles:
  # fd mode: the mounter mounts, squashfuse serves /dev/fd/3 as nobody
  # without a capability (killFUSE checks).
  - name: squashfuse
    binary: /usr/bin/squashfuse
    args: [-f, "{source}", "{mountpoint}"]
    fdMount: true
    mountOptions: [allow_other]
    source: {roots: [%[6]s]}
    mountGroupArgs: [-o, "gid={gid},umask=0002"]
    readyTimeout: 10s
  # rclone's remote comes from a configuration file that is a node-stage
  # secret (a Kubernetes Secret): here an alias of a local directory.
  - name: rclone
    binary: /usr/bin/rclone
    args: [mount, "{source}", "{mountpoint}", --config, "{secret:rcloneConf}", --cache-dir, "{workdir}", --allow-other, "{options}"]
    source: {pattern: '[a-z]+:[A-Za-z0-9/._-]*'}
    secrets: [{name: rcloneConf}]
    readyTimeout: 20s
`, r("kubelet"), r("state"), e.imageRepo, e.tag, r("srv/images"), r("srv/fuse"), e.rollout, metricsPort)
}

// install installs or upgrades the chart and waits for both DaemonSets:
// the node pod (plugin and CSI sidecars) and the mounter's.
func (e *env) install(t *testing.T) {
	t.Helper()
	e.c.helmInstall(t, e.chart, e.values())
	for _, ds := range []string{"mountplan-node", "mountplan-mounter"} {
		must(t)(e.c.kubectl("-n", "kube-system", "rollout", "status", "daemonset/"+ds, "--timeout=180s"))
	}
}

// The chart's components (app.kubernetes.io/component) and their main
// containers.
const (
	nodeComponent    = "node"    // DaemonSet mountplan-node: plugin, provisioner, snapshotter, resizer
	mounterComponent = "mounter" // DaemonSet mountplan-mounter: mounter alone
	pluginContainer  = "plugin"
	// metricsPort: the plugin's metrics and /debug/volumes, in its pod.
	metricsPort      = 29654
	mounterContainer = "mounter"
	pluginComm       = "mountplan-plugi" // /proc/PID/comm: 15 bytes
	mounterComm      = "mountplan-sidec"
)

// podOf is the name of the one pod of a component on the first node (where
// the flows' pods run), waiting (a rollout) until there is one that is not
// being deleted.
func (e *env) podOf(t *testing.T, component string) string {
	t.Helper()
	return e.podOn(t, component, nodeName)
}

// podOn is podOf on a given node.
func (e *env) podOn(t *testing.T, component, node string) string {
	t.Helper()
	var name string
	waitFor(t, 90*time.Second, "one "+component+" pod on "+node, func() error {
		out, err := e.c.kubectl("-n", "kube-system", "get", "pods", "--field-selector", "spec.nodeName="+node,
			"-l", "app.kubernetes.io/name=mountplan,app.kubernetes.io/component="+component,
			"-o", `go-template={{range .items}}{{if not .metadata.deletionTimestamp}}{{.metadata.name}}{{"\n"}}{{end}}{{end}}`)
		if err != nil {
			return err
		}
		names := strings.Fields(out)
		if len(names) != 1 {
			return fmt.Errorf("%d pods: %v", len(names), names)
		}
		name = names[0]
		return nil
	})
	return name
}

// containerStatus is a field of a container's status in a component's pod
// (jsonpath below .status.containerStatuses[name]).
func (e *env) containerStatus(t *testing.T, component, container, field string) string {
	t.Helper()
	return strings.TrimSpace(must(t)(e.c.kubectl("-n", "kube-system", "get", "pod", e.podOf(t, component), "-o",
		fmt.Sprintf(`jsonpath={.status.containerStatuses[?(@.name==%q)].%s}`, container, field))))
}

// containerExec runs a command in a container of a component's pod.
func (e *env) containerExec(t *testing.T, component, container string, cmd ...string) (string, error) {
	t.Helper()
	return e.c.kubectl(append([]string{"-n", "kube-system", "exec", e.podOf(t, component), "-c", container, "--"}, cmd...)...)
}

// containerPID finds, by container name, the host PID of the process named
// comm in a container of a component's pod: the container's ID from the
// pod's status, its processes by its cgroup (containerd puts each container
// in /<namespace>/<id>, see criNamespace).
func (e *env) containerPID(t *testing.T, component, container, comm string) int {
	t.Helper()
	var pid int
	waitFor(t, 60*time.Second, fmt.Sprintf("process %s in container %s", comm, container), func() error {
		_, id, ok := strings.Cut(e.containerStatus(t, component, container, "containerID"), "://")
		if !ok || id == "" {
			return fmt.Errorf("container %s of the %s pod has no ID yet", container, component)
		}
		var pids []int
		for p, c := range e.c.procs() {
			if c != comm {
				continue
			}
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", p)); err == nil && strings.Contains(string(b), "/"+criNamespace+"/"+id) {
				pids = append(pids, p)
			}
		}
		if len(pids) != 1 {
			return fmt.Errorf("%d processes named %s in container %s (%s): %v", len(pids), comm, container, id, pids)
		}
		pid = pids[0]
		return nil
	})
	return pid
}

// apply applies objects given as Go values (JSON is YAML).
func (e *env) apply(t *testing.T, objs ...any) {
	t.Helper()
	var docs []string
	for _, o := range objs {
		b, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, string(b))
	}
	if err := e.c.apply(strings.Join(docs, "\n---\n")); err != nil {
		t.Fatal(err)
	}
}

type obj = map[string]any

// pvc is a claim of the test namespace.
func pvc(name, class, size string, modes ...string) obj {
	if len(modes) == 0 {
		modes = []string{"ReadWriteOnce"}
	}
	spec := obj{"accessModes": modes, "resources": obj{"requests": obj{"storage": size}}}
	if class != "" {
		spec["storageClassName"] = class
	}
	return obj{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
		"metadata": obj{"name": name, "namespace": testNS}, "spec": spec}
}

// podOpt changes a pod built by pod.
type podOpt func(spec obj, ctr obj)

// pod is a busybox pod that sleeps (or runs script) with the given volumes.
func pod(name string, opts ...podOpt) obj {
	ctr := obj{"name": "c", "image": busyboxImage, "imagePullPolicy": "Never",
		"command": []string{"sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"}}
	spec := obj{"containers": []obj{ctr}, "terminationGracePeriodSeconds": 2}
	for _, o := range opts {
		o(spec, ctr)
	}
	return obj{"apiVersion": "v1", "kind": "Pod", "metadata": obj{"name": name, "namespace": testNS}, "spec": spec}
}

func addVolume(spec obj, v obj) {
	vs, _ := spec["volumes"].([]obj)
	spec["volumes"] = append(vs, v)
}

func addMount(ctr obj, m obj) {
	ms, _ := ctr["volumeMounts"].([]obj)
	ctr["volumeMounts"] = append(ms, m)
}

// withClaim mounts a claim at path.
func withClaim(claim, path string, readOnly bool) podOpt {
	return func(spec, ctr obj) {
		vol := "v-" + claim
		addVolume(spec, obj{"name": vol, "persistentVolumeClaim": obj{"claimName": claim, "readOnly": readOnly}})
		addMount(ctr, obj{"name": vol, "mountPath": path})
	}
}

func withScript(script string) podOpt {
	return func(_, ctr obj) { ctr["command"] = []string{"sh", "-c", script} }
}

// token is a random string to write and find again.
func token() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// write writes a fresh token to a file in a pod, syncs, reads it back and
// returns it.
func (e *env) write(t *testing.T, pod, file string) string {
	t.Helper()
	tok := token()
	must(t)(e.c.podExec(pod, "sh", "-c", fmt.Sprintf("echo %s > %s && sync", tok, file)))
	e.expect(t, pod, file, tok)
	return tok
}

// expect checks a file's content in a pod.
func (e *env) expect(t *testing.T, pod, file, want string) {
	t.Helper()
	got, err := e.c.podExec(pod, "cat", file)
	if err != nil {
		t.Fatalf("read %s in %s: %v", file, pod, err)
	}
	if strings.TrimSpace(got) != want {
		t.Fatalf("%s in %s: %q, want %q", file, pod, strings.TrimSpace(got), want)
	}
}

// run starts pods and waits until they are Ready.
func (e *env) run(t *testing.T, pods ...obj) {
	t.Helper()
	for _, p := range pods {
		e.apply(t, p)
	}
	for _, p := range pods {
		meta := p["metadata"].(obj)
		e.c.waitPod(t, meta["namespace"].(string)+"/"+meta["name"].(string))
	}
}

// records counts the plugin's journal records.
func (e *env) records(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(e.c.cfg.path("state", "volumes", "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// hostRun runs a command on the host (image preparation).
func hostRun(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

// procs maps host PIDs of the node's processes (those of its PID
// namespace and of the namespaces below it: the containers') to their
// command names.
func (c *Cluster) procs() map[int]string {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/pid", c.nodePID()), &st); err != nil {
		return nil
	}
	procs := map[int]string{}
	entries, _ := os.ReadDir("/proc")
	for _, d := range entries {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || !pidNSBelow(pid, st.Ino) {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "comm"))
		procs[pid] = strings.TrimSpace(string(comm))
	}
	return procs
}

// pidNSBelow says whether pid's PID namespace is ns or a descendant of it
// (NS_GET_PARENT up to the host's, which answers EPERM).
func pidNSBelow(pid int, ns uint64) bool {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/pid", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	for {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return false
		}
		if st.Ino == ns {
			unix.Close(fd)
			return true
		}
		parent, err := unix.IoctlRetInt(fd, unix.NS_GET_PARENT)
		unix.Close(fd)
		if err != nil {
			return false
		}
		fd = parent
	}
}

// pidOf finds the host PID of a node process by command name.
func (c *Cluster) pidOf(t *testing.T, comm string) int {
	t.Helper()
	var pids []int
	for pid, name := range c.procs() {
		if name == comm {
			pids = append(pids, pid)
		}
	}
	if len(pids) != 1 {
		t.Fatalf("%d processes named %s in node %s, want 1", len(pids), comm, c.cfg.name())
	}
	return pids[0]
}

// memory logs the resident memory of the node's processes by name.
func (e *env) memory(t *testing.T) {
	sum := map[string]int{}
	total := 0
	for pid, comm := range e.c.procs() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if f, ok := strings.CutPrefix(l, "VmRSS:"); ok {
				kb, _ := strconv.Atoi(strings.Fields(f)[0])
				sum[comm] += kb
				total += kb
			}
		}
	}
	var names []string
	for n := range sum {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool { return sum[names[i]] > sum[names[j]] })
	var parts []string
	for _, n := range names {
		if sum[n] >= 10*1024 {
			parts = append(parts, fmt.Sprintf("%s %d", n, sum[n]/1024))
		}
	}
	t.Logf("memory (RSS, MiB): total %d; %s", total/1024, strings.Join(parts, ", "))
}

// sleep for settling, with the reason in the code.
func sleep(d time.Duration) { time.Sleep(d) }
