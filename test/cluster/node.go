//go:build clustertest

package cluster

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

// The first node's fixed addresses, inside its own network namespace:
// nothing of them is visible on the host. It runs the control plane; the
// other nodes (workers) are numbered from 2, with addresses of the same
// pattern (workerNode).
const (
	nodeName   = "mp-node"
	nodeIP     = "10.200.0.1" // on lo: kubelet refuses a loopback node IP
	serviceIP  = "10.96.0.1"  // the kubernetes Service; no kube-proxy, so it is on lo and the API server listens on :443
	serviceNet = "10.96.0.0/16"
	podNet     = "10.244.0.0/24"
)

// workerNode is the name, address and pod network of node i (2, 3, ...).
// Its address is on its lo, as the first node's is; a veth pair joins its
// network namespace to the first node's (Cluster.wire), which routes
// between the nodes and holds the Service address.
func workerNode(i int) (name, ip, pods string) {
	return fmt.Sprintf("%s-%d", nodeName, i), fmt.Sprintf("10.200.0.%d", i), fmt.Sprintf("10.244.%d.0/24", i-1)
}

// nodeEnv carries the node's configuration (JSON) to the re-executed test
// binary that becomes the node's first process.
const nodeEnv = "MOUNTPLAN_CLUSTER_NODE"

// nodeConfig is what the node process needs.
type nodeConfig struct {
	// Root is the cluster's directory on the host: every file the cluster
	// writes lies under it, except what kubelet and the runtime write at
	// fixed paths, which are covered by directories under Root.
	Root string
	// Bin maps a program (etcd, kube-apiserver, ..., containerd, crictl) to its path.
	Bin map[string]string
	// Fixed are the host paths covered by private directories.
	Fixed []string
	// Name, IP and PodNet are the node's (the first node's constants when empty).
	Name, IP, PodNet string
	// Cluster is the first node's root when this node is a worker: a worker
	// runs only containerd and kubelet, with the first node's PKI, and its
	// kubelet's directory at the same path as the first node's (covered, in
	// Fixed) so that the chart's one kubeletDir and stateDir serve every node.
	Cluster string
	// StateImage, when set, is a filesystem image the node mounts on the
	// first node's state dir path instead of covering it with a directory:
	// a small filesystem of the node's own, whose free bytes are the room
	// the node's plugin reports (the capacity flows).
	StateImage string
	// Runtime is the node's container runtime: containerd when empty, or
	// runtimeCRIO.
	Runtime string
}

// runtimeCRIO names CRI-O as a node's runtime; crioNode is the worker
// that runs it unless envCRIO is "0" (the others run containerd).
const (
	runtimeCRIO = "cri-o"
	crioNode    = 3
	envCRIO     = "MOUNTPLAN_CLUSTER_CRIO"
)

// crioWanted: a worker runs CRI-O unless envCRIO=0, which keeps every
// node on containerd (to tell a CRI-O failure from one of the flow).
func crioWanted() bool { return os.Getenv(envCRIO) != "0" }

func (c nodeConfig) crio() bool { return c.Runtime == runtimeCRIO }

// runtimeSocket is the node's CRI endpoint (a path).
func (c nodeConfig) runtimeSocket() string {
	if c.crio() {
		return c.path("run", "crio.sock")
	}
	return c.path("run", "containerd.sock")
}

// runtimeName is the runtime's component name.
func (c nodeConfig) runtimeName() string {
	if c.crio() {
		return "crio"
	}
	return "containerd"
}

// containerCgroup is what the cgroup path of a container's processes
// contains: containerd puts it at /<namespace>/<id>, CRI-O at crio-<id>
// (and its conmon at crio-conmon-<id>, which this does not match).
func (c nodeConfig) containerCgroup(id string) string {
	if c.crio() {
		return "/crio-" + id
	}
	return "/" + criNamespace + "/" + id
}

func (c nodeConfig) path(p ...string) string { return filepath.Join(append([]string{c.Root}, p...)...) }

func (c nodeConfig) worker() bool { return c.Cluster != "" }

// clusterPath is a path under the first node's root, which holds the PKI
// and the kubelet directory's path.
func (c nodeConfig) clusterPath(p ...string) string {
	if c.worker() {
		return filepath.Join(append([]string{c.Cluster}, p...)...)
	}
	return c.path(p...)
}

func (c nodeConfig) name() string { return cmp.Or(c.Name, nodeName) }
func (c nodeConfig) ip() string   { return cmp.Or(c.IP, nodeIP) }
func (c nodeConfig) pods() string { return cmp.Or(c.PodNet, podNet) }

// fixedSource is the private directory that covers a fixed host path.
func (c nodeConfig) fixedSource(p string) string {
	return c.path("fixed", strings.ReplaceAll(strings.Trim(p, "/"), "/", "_"))
}

// nodeMain runs as the first process of the node's PID, mount and network
// namespaces: it sets them up, starts the control plane, containerd and
// kubelet, restarts any of them that exits, and on SIGTERM stops them in
// order and reports what was left.
func nodeMain() int {
	var cfg nodeConfig
	if err := json.Unmarshal([]byte(os.Getenv(nodeEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "node config:", err)
		return 2
	}
	n := &node{cfg: cfg, procs: map[int]*proc{}}
	// run returns only when the node could not start; SIGTERM ends the
	// process from its handler.
	err := n.run()
	n.logf("node failed: %v", err)
	_ = os.WriteFile(cfg.path("node", "failed"), []byte(err.Error()), 0o644)
	n.stopAll()
	return 1
}

type node struct {
	cfg   nodeConfig
	mu    sync.Mutex
	procs map[int]*proc // by PID, alive ones
	stop  bool
}

// proc is a process the node started: a component (restarted when it
// exits) or a one-shot command.
type proc struct {
	name    string
	argv    []string
	env     []string // besides the node's
	restart bool
	pid     int
	exited  chan struct{}
	status  unix.WaitStatus
}

func (n *node) logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s node: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func (n *node) run() error {
	// Reap everything: the node is PID 1 of its namespace, orphans (shims,
	// daemons) end up here. Reaping runs apart from stopping, which waits
	// for what it reaps.
	chld, term := make(chan os.Signal, 64), make(chan os.Signal, 1)
	signal.Notify(chld, unix.SIGCHLD)
	signal.Notify(term, unix.SIGTERM, unix.SIGINT)
	go func() {
		for range chld {
			n.reap()
		}
	}()
	go func() {
		s := <-term
		n.logf("%v: stopping", s)
		n.stopAll()
		os.Exit(0)
	}()
	if err := n.setupMounts(); err != nil {
		return fmt.Errorf("mounts: %w", err)
	}
	addrs := [][]string{
		{"ip", "link", "set", "lo", "up"},
		{"ip", "addr", "add", n.cfg.ip() + "/32", "dev", "lo"},
	}
	if !n.cfg.worker() {
		addrs = append(addrs, []string{"ip", "addr", "add", serviceIP + "/32", "dev", "lo"})
	}
	for _, args := range addrs {
		if err := n.runCmd(args...); err != nil {
			return err
		}
	}
	for _, c := range n.components() {
		if _, err := n.spawn(&proc{name: c.name, argv: c.argv, env: c.env, restart: true}); err != nil {
			return err
		}
		if c.ready != nil {
			if err := waitUntil(90*time.Second, c.ready); err != nil {
				return fmt.Errorf("%s not ready: %w (log: %s)", c.name, err, n.cfg.path("logs", c.name+".log"))
			}
		}
		n.logf("%s started", c.name)
	}
	if err := os.WriteFile(n.cfg.path("node", "ready"), nil, 0o644); err != nil {
		return err
	}
	select {} // until SIGTERM
}

// setupMounts: nothing mounted here reaches the host (/ is made private
// first), /proc is this PID namespace's, each fixed path kubelet or the
// runtime writes is covered by a directory under Root, and / becomes shared
// inside so that Bidirectional mounts of the plugin's pod work.
func (n *node) setupMounts() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	for _, p := range n.cfg.Fixed {
		if n.cfg.StateImage != "" && p == n.cfg.clusterPath("state") {
			// mount(8) attaches the loop device with autoclear: it goes
			// with the node's mount namespace.
			if err := n.runCmd("mount", "-o", "loop", n.cfg.StateImage, p); err != nil {
				return fmt.Errorf("state filesystem: %w", err)
			}
			continue
		}
		src := n.cfg.fixedSource(p)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(src, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("cover %s: %w", p, err)
		}
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make / shared: %w", err)
	}
	return nil
}

type component struct {
	name  string
	argv  []string
	env   []string // besides the node's (environ)
	ready func() error
}

func (n *node) components() []component {
	c := n.cfg
	pki := func(f string) string { return c.clusterPath("pki", f) }
	rt := component{name: "containerd", argv: []string{c.Bin["containerd"], "--config=" + c.path("containerd.toml")}}
	if c.crio() {
		rt = component{name: "crio", argv: testutil.CRIOArgs(c.Bin["crio"], c.crioOptions().Dir), env: testutil.CRIOEnv(c.crioOptions().Dir)}
	}
	rt.ready = dialable("unix", c.runtimeSocket())
	runtime := []component{
		rt,
		{name: "kubelet", argv: []string{c.Bin["kubelet"], "--config=" + c.path("kubelet.yaml"),
			"--kubeconfig=" + pki("kubelet-"+c.name()+".kubeconfig"), "--root-dir=" + c.clusterPath("kubelet"),
			"--node-ip=" + c.ip(), "--hostname-override=" + c.name(), "--cert-dir=" + c.path("kubelet-pki"),
			"--v=2"}},
	}
	if c.worker() {
		return runtime
	}
	return append([]component{
		{name: "etcd", argv: []string{c.Bin["etcd"], "--name=mp", "--data-dir=" + c.path("etcd"),
			"--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
			"--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
			"--initial-cluster=mp=http://127.0.0.1:2380", "--log-level=warn", "--unsafe-no-fsync"},
			ready: dialable("tcp", "127.0.0.1:2379")},
		{name: "kube-apiserver", argv: []string{c.Bin["kube-apiserver"],
			"--etcd-servers=http://127.0.0.1:2379", "--bind-address=0.0.0.0", "--secure-port=443",
			"--advertise-address=" + nodeIP, "--service-cluster-ip-range=" + serviceNet,
			"--tls-cert-file=" + pki("apiserver.crt"), "--tls-private-key-file=" + pki("apiserver.key"),
			"--client-ca-file=" + pki("ca.crt"), "--token-auth-file=" + pki("tokens.csv"),
			"--authorization-mode=Node,RBAC", "--allow-privileged=true",
			"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file=" + pki("sa.pub"),
			"--service-account-signing-key-file=" + pki("sa.key"),
			"--kubelet-preferred-address-types=InternalIP,Hostname", "--profiling=false",
			"--feature-gates=CSIVolumeHealth=true",
			// The flows' namespace keeps its pods on the first node (its
			// annotation); the multi-node flows use namespaces of their own.
			"--enable-admission-plugins=PodNodeSelector"},
			ready: apiReady(pki("admin.kubeconfig"))},
		{name: "kube-controller-manager", argv: []string{c.Bin["kube-controller-manager"],
			"--kubeconfig=" + pki("controller-manager.kubeconfig"), "--leader-elect=false", "--secure-port=0",
			"--service-account-private-key-file=" + pki("sa.key"), "--root-ca-file=" + pki("ca.crt"), "--use-service-account-credentials=true",
			"--controllers=*,-nodeipam", "--profiling=false",
			// Its client's default limits (20 requests a second, bursts of
			// 30) made the volume controller bind 90 new claims at about
			// four a second, in order: a claim waited up to 8.5 s between
			// its volume's creation and its binding (bench-cluster).
			"--kube-api-qps=200", "--kube-api-burst=400"}},
		// external-snapshotter's common controller, with each node's
		// csi-snapshotter (the chart's, --node-deployment) taking its own
		// volumes' snapshots. It waits for the snapshot CRDs, which the test
		// applies before installing the chart.
		{name: "snapshot-controller", argv: []string{c.Bin["snapshot-controller"],
			"--kubeconfig=" + pki("admin.kubeconfig"), "--enable-distributed-snapshotting", "--retry-crd-interval-max=5m"}},
		{name: "kube-scheduler", argv: []string{c.Bin["kube-scheduler"],
			// -v=2: each pod's binding, with its time, in the log
			// bench-cluster keeps.
			"--kubeconfig=" + pki("scheduler.kubeconfig"), "--leader-elect=false", "--secure-port=0", "--profiling=false", "--v=2",
			// As the controller manager's: 90 pods bound at once.
			"--kube-api-qps=200", "--kube-api-burst=400"}},
	}, runtime...)
}

func dialable(network, addr string) func() error {
	return func() error {
		c, err := net.DialTimeout(network, addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err
	}
}

// apiReady asks /readyz with the admin's token.
func apiReady(kubeconfigFile string) func() error {
	return func() error {
		b, err := os.ReadFile(kubeconfigFile)
		if err != nil {
			return err
		}
		_, rest, _ := strings.Cut(string(b), "token: \"")
		token, _, _ := strings.Cut(rest, "\"")
		req, err := http.NewRequest(http.MethodGet, "https://"+nodeIP+":443/readyz", nil)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+token)
		cl := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
		resp, err := cl.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("readyz: %s", resp.Status)
		}
		return nil
	}
}

func waitUntil(d time.Duration, f func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// spawn starts a process whose output goes to logs/<name>.log.
func (n *node) spawn(p *proc) (*proc, error) {
	if err := os.MkdirAll(n.cfg.path("logs"), 0o755); err != nil {
		return nil, err
	}
	log, err := os.OpenFile(n.cfg.path("logs", p.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stop && p.restart {
		return nil, errors.New("stopping")
	}
	pr, err := os.StartProcess(p.argv[0], p.argv, &os.ProcAttr{
		Env:   append(n.environ(), p.env...),
		Files: []*os.File{nil, log, log},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", p.name, err)
	}
	p.pid = pr.Pid
	p.exited = make(chan struct{})
	_ = pr.Release() // reaped by reap, not by os.Process
	n.procs[p.pid] = p
	return p, nil
}

// environ is the components' environment: the node's own without PATH and
// the node's configuration, and a PATH on which containerd finds its shim,
// ours before Debian's (containerd 1.6, which other tests use, in /usr/bin).
func (n *node) environ() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PATH=") && !strings.HasPrefix(kv, nodeEnv+"=") {
			env = append(env, kv)
		}
	}
	return append(env, "PATH="+filepath.Dir(n.cfg.Bin["containerd"])+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
}

// runCmd runs a one-shot command to its end.
func (n *node) runCmd(argv ...string) error {
	p, err := n.spawn(&proc{name: "cmd-" + filepath.Base(argv[0]), argv: resolve(argv)})
	if err != nil {
		return err
	}
	<-p.exited
	if !p.status.Exited() || p.status.ExitStatus() != 0 {
		return fmt.Errorf("%q: %v (log: %s)", argv, p.status, n.cfg.path("logs", p.name+".log"))
	}
	return nil
}

func resolve(argv []string) []string {
	if !strings.Contains(argv[0], "/") {
		for _, d := range []string{"/usr/sbin", "/usr/bin", "/sbin", "/bin"} {
			if _, err := os.Stat(filepath.Join(d, argv[0])); err == nil {
				return append([]string{filepath.Join(d, argv[0])}, argv[1:]...)
			}
		}
	}
	return argv
}

// reap collects every exited child; a component that exited while the node
// runs is started again after a second.
func (n *node) reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
		n.mu.Lock()
		p := n.procs[pid]
		delete(n.procs, pid)
		stopping := n.stop
		n.mu.Unlock()
		if p == nil {
			continue // an orphan
		}
		p.status = ws
		close(p.exited)
		if p.restart && !stopping {
			n.logf("%s (pid %d) exited: %v; restarting", p.name, pid, ws)
			go func() {
				time.Sleep(time.Second)
				n.whileHeld(p.name)
				if _, err := n.spawn(&proc{name: p.name, argv: p.argv, env: p.env, restart: true}); err != nil {
					n.logf("restart %s: %v", p.name, err)
				}
			}()
		}
	}
}

// stopAll stops kubelet, removes every pod sandbox left (so that runc
// removes their cgroups), stops containerd and the control plane, and
// writes what was still running to node/leftover before killing it.
func (n *node) stopAll() {
	n.mu.Lock()
	n.stop = true
	n.mu.Unlock()
	n.terminate("kubelet", 30*time.Second)
	if crictl := n.cfg.Bin["crictl"]; crictl != "" {
		sock := "unix://" + n.cfg.runtimeSocket()
		if err := n.runCmd(crictl, "--runtime-endpoint", sock, "--timeout", "60s", "rmp", "--all", "--force"); err != nil {
			n.logf("crictl rmp: %v", err)
		}
	}
	for _, name := range []string{n.cfg.runtimeName(), "snapshot-controller", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"} {
		n.terminate(name, 20*time.Second)
	}
	// Whatever is left (shims, daemons of pods that were not deleted):
	// recorded as a leak, then killed.
	var left []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == 1 {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		left = append(left, fmt.Sprintf("%d %s", pid, strings.TrimSpace(string(comm))))
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	_ = os.WriteFile(n.cfg.path("node", "leftover"), []byte(strings.Join(left, "\n")), 0o644)
	n.logf("stopped; %d processes left", len(left))
}

// terminate sends SIGTERM to every process of a component, SIGKILL after d.
func (n *node) terminate(name string, d time.Duration) {
	n.mu.Lock()
	var ps []*proc
	for _, p := range n.procs {
		if p.name == name {
			ps = append(ps, p)
		}
	}
	n.mu.Unlock()
	for _, p := range ps {
		_ = unix.Kill(p.pid, unix.SIGTERM)
		ctx, cancel := context.WithTimeout(context.Background(), d)
		select {
		case <-p.exited:
		case <-ctx.Done():
			n.logf("%s did not stop in %v: killed", name, d)
			_ = unix.Kill(p.pid, unix.SIGKILL)
			<-p.exited
		}
		cancel()
	}
}

// holdPath is a file whose presence keeps the node from restarting a
// component that exited: a test holds containerd down this way, as long
// as it likes, and releases it by removing the file.
func (c nodeConfig) holdPath(component string) string { return c.path("node", "hold-"+component) }

// whileHeld waits while a component is held (holdPath) and the node runs.
func (n *node) whileHeld(name string) {
	for logged := false; ; logged = true {
		n.mu.Lock()
		stopping := n.stop
		n.mu.Unlock()
		if _, err := os.Stat(n.cfg.holdPath(name)); err != nil || stopping {
			return
		}
		if !logged {
			n.logf("%s held down until %s is removed", name, n.cfg.holdPath(name))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
