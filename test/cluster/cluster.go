//go:build clustertest

package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Cluster is a running cluster: its first node's process (PID 1 of the
// node's namespaces, seen from the host), which runs the control plane,
// its directory, and its other nodes (workers), each a Cluster of its own
// directory whose process runs containerd and kubelet.
type Cluster struct {
	cfg     nodeConfig
	node    *exec.Cmd
	created []string      // fixed host paths created for covering, removed at the end
	started time.Time     // when the node process last started
	exited  chan struct{} // closed when the node process has exited
	workers []*Cluster
}

// programs the node needs, by name; tools maps a name to a bin directory.
var programs = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl",
	"containerd", "containerd-shim-runc-v2", "ctr", "crictl", "helm", "snapshot-controller",
	"kubectl-mountplan", "runc"}

// fixedPaths are written by kubelet, containerd or CNI whatever their
// configured directories: each is covered inside the node by a directory
// under the root (created on the host first when missing, removed after).
var fixedPaths = []string{
	"/var/lib/kubelet",    // device-plugins
	"/var/log/pods",       // kubelet
	"/var/log/containers", // kubelet's symlinks
	"/var/lib/cni",        // CNI results cache
	"/run/netns",          // pod network namespaces
	"/run/containerd",     // shim sockets
	"/var/lib/containerd",
	"/run/nri",
	"/etc/cni/net.d",
	"/var/lib/containers", // CRI-O's node: containers-storage's defaults
	"/run/containers",
	"/run/crio",
	"/var/lib/crio",
}

// startCluster builds the root directory and starts the nodes (the first,
// then nodes-1 workers); the nodes' components run when it returns.
func startCluster(t *testing.T, root string, path []string, nodes int) *Cluster {
	t.Helper()
	cfg := nodeConfig{Root: root, Bin: map[string]string{}, Fixed: fixedPaths}
	wanted := programs
	if crioWanted() {
		wanted = append(slices.Clone(programs), "crio")
	}
	for _, name := range wanted {
		p, err := lookPath(name, path)
		if err != nil {
			t.Fatalf("%v (make test-cluster builds them with hack/tools/build.sh)", err)
		}
		cfg.Bin[name] = p
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	c := &Cluster{cfg: cfg}
	for _, p := range fixedPaths {
		top, err := mkdirRecording(p)
		if err != nil {
			t.Fatal(err)
		}
		if top != "" {
			c.created = append(c.created, top)
		}
	}
	// Recorded for an interrupted run's successor (cleanStale).
	if err := os.WriteFile(cfg.path("created"), []byte(strings.Join(c.created, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	names := []string{nodeName}
	for i := 2; i <= nodes; i++ {
		name, _, _ := workerNode(i)
		names = append(names, name)
	}
	if err := writePKI(cfg.path("pki"), names); err != nil {
		t.Fatal(err)
	}
	if err := writeConfigs(cfg); err != nil {
		t.Fatal(err)
	}
	c.startNode(t)
	for i := 2; i <= nodes; i++ {
		c.startWorker(t, i)
	}
	return c
}

// startWorker starts node i: its directory is <root>/nodes/<name>, and it
// covers, besides the fixed paths, the first node's kubelet and state
// directories (the chart's kubeletDir and stateDir, and the mounter's
// records next to the state dir) with its own. Its state dir is an ext4
// of its own, node i's of (i-1)×512 MiB, so that the capacity flows have
// nodes with little and different room.
func (c *Cluster) startWorker(t *testing.T, i int) {
	t.Helper()
	name, ip, pods := workerNode(i)
	cfg := nodeConfig{Root: c.cfg.path("nodes", name), Bin: c.cfg.Bin, Name: name, IP: ip, PodNet: pods, Cluster: c.cfg.Root,
		Fixed:      append(slices.Clone(fixedPaths), c.cfg.path("kubelet"), c.cfg.path("state"), c.cfg.path("state")+"-mounter"),
		StateImage: c.cfg.path("nodes", name, "state.ext4")}
	if i == crioNode && crioWanted() {
		cfg.Runtime = runtimeCRIO
	}
	for _, d := range []string{c.cfg.path("kubelet"), c.cfg.path("state"), c.cfg.path("state") + "-mounter", cfg.path("logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := writeConfigs(cfg); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(cfg.StateImage, 0); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "nodiscard", cfg.StateImage, fmt.Sprintf("%dM", (i-1)*512)).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v: %s", cfg.StateImage, err, out)
	}
	w := &Cluster{cfg: cfg}
	w.startNode(t)
	c.workers = append(c.workers, w)
	c.wire(t, w, i)
}

// wire joins a worker's network namespace to the first node's with a veth
// pair (mpn<i> on the first node, eth0 on the worker), routes the worker's
// address and pod network through it, and routes everything else of the
// worker (the first node, the Service address, the other workers) to the
// first node, which forwards. Called again after the first node's reboot,
// whose network namespace took the pair with it.
func (c *Cluster) wire(t *testing.T, w *Cluster, i int) {
	t.Helper()
	link := fmt.Sprintf("mpn%d", i)
	first, worker := strconv.Itoa(c.nodePID()), strconv.Itoa(w.nodePID())
	// The pair of the first node's last boot: the kernel removes its end
	// in the dead network namespace, and with it the worker's, only when
	// it gets to that namespace's cleanup, which may be after this.
	_ = exec.Command("nsenter", "-t", worker, "-n", "ip", "link", "del", "eth0").Run()
	for _, argv := range [][]string{
		{"ip", "link", "add", link, "netns", first, "type", "veth", "peer", "name", "eth0", "netns", worker},
		{"nsenter", "-t", first, "-n", "ip", "link", "set", link, "up"},
		{"nsenter", "-t", first, "-n", "ip", "route", "replace", w.cfg.ip() + "/32", "dev", link},
		{"nsenter", "-t", first, "-n", "ip", "route", "replace", w.cfg.pods(), "via", w.cfg.ip(), "dev", link},
		{"nsenter", "-t", first, "-n", "sysctl", "-qw", "net.ipv4.ip_forward=1"},
		{"nsenter", "-t", worker, "-n", "ip", "link", "set", "eth0", "up"},
		{"nsenter", "-t", worker, "-n", "ip", "route", "replace", nodeIP + "/32", "dev", "eth0"},
		{"nsenter", "-t", worker, "-n", "ip", "route", "replace", "default", "via", nodeIP, "dev", "eth0"},
	} {
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("wire %s: %q: %v: %s", w.cfg.name(), argv, err, out)
		}
	}
}

// seen is the host path at which a path of the node's mount namespace is
// seen: the same path on the first node, whose covered paths hold nothing
// the tests look at, through /proc/<pid>/root on a worker, whose state and
// kubelet directories are its own.
func (c *Cluster) seen(p string) string {
	if !c.cfg.worker() {
		return p
	}
	return fmt.Sprintf("/proc/%d/root%s", c.nodePID(), p)
}

// nodes is the first node and the workers.
func (c *Cluster) nodes() []*Cluster { return append([]*Cluster{c}, c.workers...) }

// startNode starts the node process on the cluster's root, with the PKI and
// configuration already there (a first start, or a boot after reboot), and
// waits until its components run.
func (c *Cluster) startNode(t *testing.T) {
	t.Helper()
	cfg := c.cfg
	js, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Appended to: a reboot's log follows the first boot's.
	log, err := os.OpenFile(cfg.path("logs", "node.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	c.started = time.Now()
	c.node = exec.Command(os.Args[0])
	c.node.Env = append(os.Environ(), nodeEnv+"="+string(js))
	c.node.Stdout, c.node.Stderr = log, log
	c.node.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET,
		Pdeathsig:  unix.SIGTERM, // the test died: the node stops in order
	}
	if err := c.node.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	c.exited = exited
	go func() { _ = c.node.Wait(); close(exited) }()
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if _, err := os.Stat(cfg.path("node", "ready")); err == nil {
			break
		}
		if b, err := os.ReadFile(cfg.path("node", "failed")); err == nil {
			t.Fatalf("node failed: %s\n%s", b, tail(cfg.path("logs", "node.log"), 30))
		}
		select {
		case <-exited:
			t.Fatalf("node exited: %v\n%s", c.node.ProcessState, tail(cfg.path("logs", "node.log"), 30))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("node not up after 3 minutes\n%s", tail(cfg.path("logs", "node.log"), 30))
		}
	}
	if cfg.worker() {
		t.Logf("node %s: %s and kubelet up in %v", cfg.name(), cfg.runtimeName(), time.Since(c.started).Round(time.Millisecond))
		return
	}
	t.Logf("control plane, containerd and kubelet up in %v", time.Since(c.started).Round(time.Millisecond))
}

func lookPath(name string, path []string) (string, error) {
	for _, d := range path {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in %v", name, path)
}

// mkdirRecording creates p and returns the topmost directory it created
// ("" when p existed).
func mkdirRecording(p string) (string, error) {
	top := ""
	for d := p; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		}
		top = d
	}
	return top, os.MkdirAll(p, 0o755)
}

// nodePID is the node process's PID on the host.
func (c *Cluster) nodePID() int { return c.node.Process.Pid }

// inNode runs a program inside the node's network namespace (the API
// server and kubelet listen there) and returns its output.
func (c *Cluster) inNode(ctx context.Context, stdin []byte, prog string, args ...string) (string, error) {
	cmd := c.nodeCommand(ctx, prog, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// nodeCommand is a command of the cluster's programs in the node's network
// namespace, with the admin's kubeconfig and helm's directories.
func (c *Cluster) nodeCommand(ctx context.Context, prog string, args ...string) *exec.Cmd {
	full := append([]string{"--target", strconv.Itoa(c.nodePID()), "--net", "--", c.cfg.Bin[prog]}, args...)
	cmd := exec.CommandContext(ctx, "nsenter", full...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.cfg.path("pki", "admin.kubeconfig"),
		"HELM_CACHE_HOME="+c.cfg.path("helm", "cache"), "HELM_CONFIG_HOME="+c.cfg.path("helm", "config"),
		"HELM_DATA_HOME="+c.cfg.path("helm", "data"))
	return cmd
}

// kubectl runs kubectl with a minute's timeout.
func (c *Cluster) kubectl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return c.inNode(ctx, nil, "kubectl", args...)
}

// apply applies a manifest.
func (c *Cluster) apply(manifest string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := c.inNode(ctx, []byte(manifest), "kubectl", "apply", "-f", "-")
	return err
}

// stop stops the node in order (kubelet, sandboxes, containerd, control
// plane), then removes the fixed paths it created. It returns what the node
// found still running (a leak).
func (c *Cluster) stop() ([]string, error) {
	var errs []error
	var left []string
	// Workers first: their kubelets delete their sandboxes without the
	// control plane.
	for _, w := range c.workers {
		wl, err := w.stop()
		for _, l := range wl {
			left = append(left, w.cfg.name()+": "+l)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", w.cfg.name(), err))
		}
	}
	if c.node.ProcessState == nil {
		_ = c.node.Process.Signal(unix.SIGTERM)
		done := make(chan struct{})
		go func() {
			for c.node.ProcessState == nil {
				if err := unix.Kill(c.nodePID(), 0); err != nil {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(3 * time.Minute):
			_ = c.node.Process.Kill()
			errs = append(errs, errors.New("node did not stop in 3 minutes: killed"))
		}
	}
	if b, err := os.ReadFile(c.cfg.path("node", "leftover")); err == nil && len(bytes.TrimSpace(b)) > 0 {
		left = append(left, strings.Split(strings.TrimSpace(string(b)), "\n")...)
	}
	for i := len(c.created) - 1; i >= 0; i-- {
		if err := removeEmptyTree(c.created[i]); err != nil {
			errs = append(errs, err)
		}
	}
	return left, errors.Join(errs...)
}

// removeEmptyTree removes a tree of empty directories (it was only a mount
// point): anything else in it is an error.
func removeEmptyTree(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		return err
	}
	for _, e := range entries {
		if !e.IsDir() {
			return fmt.Errorf("%s: written on the host, outside the node's covered paths", filepath.Join(dir, e.Name()))
		}
		if err := removeEmptyTree(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return os.Remove(dir)
}

// tail is the end of a log file.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return lastLines(string(b), n)
}
