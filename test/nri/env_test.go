package nri_test

// The environment of the NRI tests: a private containerd 2 with CRI and NRI
// (testutil.StartCRI), the real mountplan-plugin (--nri) and the real
// mountplan-sidecar serve (--nri) as subprocesses, a fake kubelet root
// under which the tests lay out pods' target paths the way kubelet does,
// and a poller of the host's mount table that runs through every test.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/nri/guard"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestMain(m *testing.M) { testutil.Main(m) }

const rpcTimeout = time.Minute

type env struct {
	t       testing.TB
	cri     *testutil.CRI
	plugin  *testutil.Plugin
	sidecar *proc
	conn    *grpc.ClientConn
	node    csi.NodeClient
	ctl     csi.ControllerClient
	np      api.NodePrepareClient
	kubelet string // the fake kubelet root
	poller  *hostPoller
}

type envOptions struct {
	pluginArgs  []string // more plugin flags
	sidecarArgs []string // more sidecar serve flags
	noNRIPlugin bool     // run the plugin without --nri
	config      string   // the plugin's config file (YAML); empty: ext4 default only
	noPoller    bool     // no poller of the host's mount table (a benchmark: it costs CPU)
}

func newEnv(t testing.TB, o envOptions) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	pluginBin, sidecarBin := testutil.BuildBinaries(t)
	e := &env{t: t, cri: startRuntime(t), kubelet: filepath.Join(t.TempDir(), "kubelet")}
	if !o.noPoller {
		e.poller = startHostPoller(t, e.kubelet)
	}
	cfg := o.config
	if cfg == "" {
		cfg = filepath.Join(t.TempDir(), "config.yaml")
		if err := os.WriteFile(cfg, []byte("defaultFsType: ext4\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mounterEP := "unix://" + filepath.Join(e.cri.Dir, "mounter.sock")
	args := []string{"--config", cfg, "--mounter-endpoint", mounterEP, "--kubelet-dir", e.kubelet, "--v=4"}
	if !o.noNRIPlugin {
		args = append(args, "--nri")
	}
	e.plugin = testutil.StartPlugin(t, pluginBin, append(args, o.pluginArgs...)...)
	e.sidecar = startProc(t, "sidecar", filepath.Join(e.cri.Dir, "sidecar.log"), append([]string{sidecarBin, "serve",
		"--endpoint", mounterEP, "--state-dir", e.plugin.StateDir, "--config", cfg,
		"--nri", "--nri-socket", e.cri.NRISocket, "--plugin-endpoint", e.plugin.Endpoint,
		"--kubelet-dir", e.kubelet, "--v=4"}, o.sidecarArgs...)...)
	conn, err := endpoint.Dial(e.plugin.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.conn, e.node, e.ctl, e.np = conn, csi.NewNodeClient(conn), csi.NewControllerClient(conn), api.NewNodePrepareClient(conn)
	e.waitPluginReady()
	e.waitHook()
	return e
}

// crioTests is the prefix of the tests that run under CRI-O: TestCRIO's
// subtests, each one of this package's tests (runtime_test.go).
const crioTests = "TestCRIO/"

// startRuntime starts the test's container runtime: containerd, or CRI-O
// for TestCRIO's subtests.
func startRuntime(t testing.TB) *testutil.CRI {
	if strings.HasPrefix(t.Name(), crioTests) {
		return testutil.StartCRIO(t)
	}
	return testutil.StartCRI(t)
}

func (e *env) crio() bool { return e.cri.Runtime == "CRI-O" }

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	e.t.Cleanup(cancel)
	return ctx
}

func (e *env) waitPluginReady() {
	e.t.Helper()
	ids := csi.NewIdentityClient(e.conn)
	if !testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		resp, err := ids.Probe(e.ctx(), &csi.ProbeRequest{})
		return err == nil && resp.GetReady().GetValue()
	}) {
		e.t.Fatal("plugin not ready within 30s")
	}
}

// waitHook waits until the sidecar's hook has registered with the runtime
// and synchronized: its guard is then up.
func (e *env) waitHook() {
	e.t.Helper()
	if !testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		_, err := os.Stat(guard.Path(e.plugin.StateDir))
		return err == nil
	}) {
		e.t.Fatalf("the sidecar's NRI hook did not register within 30s; sidecar log:\n%s", e.sidecar.log())
	}
}

// --- volumes ---

func mountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
}

func blockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
}

// createVolume provisions a 32 MiB ext4 loop volume as a StorageClass with
// nri: "true" would, and returns its ID and the context the PV would carry.
func (e *env) createVolume(name string, c *csi.VolumeCapability) (string, map[string]string) {
	e.t.Helper()
	return e.createVolumeOf(name, c, 32<<20, nil)
}

// createVolumeOf is createVolume with a size and more StorageClass
// parameters.
func (e *env) createVolumeOf(name string, c *csi.VolumeCapability, size int64, params map[string]string) (string, map[string]string) {
	e.t.Helper()
	params = maps.Clone(params)
	if params == nil {
		params = map[string]string{}
	}
	params["nri"] = "true"
	resp, err := e.ctl.CreateVolume(e.ctx(), &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		Parameters: params, VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	vctx := resp.GetVolume().GetVolumeContext()
	if vctx["nri"] != "true" {
		e.t.Fatalf("CreateVolume: the volume context %v does not carry the StorageClass's nri: \"true\"", vctx)
	}
	return resp.GetVolume().GetVolumeId(), vctx
}

// staging is where kubelet would stage a volume.
func (e *env) staging(id string) string {
	return filepath.Join(e.kubelet, "plugins", "kubernetes.io", "csi", "mountplan.csi.io", id, "globalmount")
}

func (e *env) stage(id string, c *csi.VolumeCapability, vctx map[string]string) {
	e.t.Helper()
	if _, err := e.node.NodeStageVolume(e.ctx(), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id),
		VolumeCapability: c, VolumeContext: vctx}); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
}

// unstage unstages id as kubelet does: asked again while the volume is
// busy with another operation (Aborted).
func (e *env) unstage(id string) error {
	return testutil.RetryAborted(func() error {
		_, err := e.node.NodeUnstageVolume(e.ctx(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)})
		return err
	})
}

// target is kubelet's target path of volume pv in pod uid; for block
// access, the file kubelet publishes the device at.
func (e *env) target(uid, pv string, block bool) string {
	if block {
		return filepath.Join(e.kubelet, "plugins", "kubernetes.io", "csi", "volumeDevices", "publish", pv, uid)
	}
	return filepath.Join(e.kubelet, "pods", uid, "volumes", "kubernetes.io~csi", pv, "mount")
}

type publishOptions struct {
	readOnly   bool
	mountGroup string
}

// publish does what kubelet does: makes the target's parent, then calls
// NodePublishVolume with the PV's context.
func (e *env) publish(id, target string, c *csi.VolumeCapability, vctx map[string]string, o publishOptions) error {
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		e.t.Fatal(err)
	}
	if o.mountGroup != "" {
		c = cloneCap(c)
		c.GetMount().VolumeMountGroup = o.mountGroup
	}
	_, err := e.node.NodePublishVolume(e.ctx(), &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id),
		TargetPath: target, VolumeCapability: c, VolumeContext: vctx, Readonly: o.readOnly})
	return err
}

func (e *env) mustPublish(id, target string, c *csi.VolumeCapability, vctx map[string]string, o publishOptions) {
	e.t.Helper()
	if err := e.publish(id, target, c, vctx, o); err != nil {
		e.t.Fatalf("NodePublishVolume %s at %s: %v", id, target, err)
	}
}

// unpublish unpublishes id at target as kubelet does: asked again while
// the volume is busy with another operation (Aborted: the plugin's
// reconcile, set off by a container's end, may hold its lock).
func (e *env) unpublish(id, target string) {
	e.t.Helper()
	if err := testutil.RetryAborted(func() error {
		_, err := e.node.NodeUnpublishVolume(e.ctx(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		return err
	}); err != nil {
		e.t.Fatalf("NodeUnpublishVolume %s at %s: %v", id, target, err)
	}
}

// podWithVolume provisions a volume in NRI mode for capability c, stages
// it, runs a pod and publishes the volume for it, as kubelet would.
func (e *env) podWithVolume(name string, c *csi.VolumeCapability, o publishOptions) (id string, pod *testutil.Pod, target string) {
	e.t.Helper()
	id, vctx := e.createVolume(name, c)
	e.stage(id, c, vctx)
	pod = e.cri.RunPod(e.t, "p-"+name)
	target = e.target(pod.UID, "pv-"+name, c.GetBlock() != nil)
	e.mustPublish(id, target, c, vctx, o)
	e.t.Cleanup(func() {
		// A test that failed before finish leaves its publish: detached
		// here, so that the leak check reports what the failure did not
		// explain. A finished test has unmounted it already.
		if e.t.Failed() {
			_ = unix.Unmount(target, unix.MNT_DETACH)
		}
	})
	return id, pod, target
}

// finish does what kubelet and the provisioner do once a volume's pods are
// gone: the pods removed, it has no consumer left; it is unpublished from
// each target, unstaged and deleted.
func (e *env) finish(id string, pods []*testutil.Pod, targets ...string) {
	e.t.Helper()
	for _, p := range pods {
		if err := p.Remove(); err != nil {
			e.t.Fatal(err)
		}
	}
	e.wantConsumers(id)
	for _, target := range targets {
		e.unpublish(id, target)
	}
	if err := e.unstage(id); err != nil {
		e.t.Fatalf("NodeUnstageVolume %s once its pods are gone: %v", id, err)
	}
	e.deleteVolume(id)
}

func (e *env) deleteVolume(id string) {
	e.t.Helper()
	if _, err := e.ctl.DeleteVolume(e.ctx(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		e.t.Fatalf("DeleteVolume %s: %v", id, err)
	}
}

func cloneCap(c *csi.VolumeCapability) *csi.VolumeCapability {
	return proto.Clone(c).(*csi.VolumeCapability)
}

// --- the journal, read from its files ---

func (e *env) record(id string) *model.Volume {
	e.t.Helper()
	b, err := os.ReadFile(filepath.Join(e.plugin.StateDir, "volumes", id+".json"))
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		e.t.Fatal(err)
	}
	v := &model.Volume{}
	if err := json.Unmarshal(b, v); err != nil {
		e.t.Fatalf("journal record %s: %v", id, err)
	}
	return v
}

// consumers returns the container IDs the journal records as consumers of
// id, each with whether its namespace is recorded.
func (e *env) consumers(id string) map[string]bool {
	e.t.Helper()
	out := map[string]bool{}
	if v := e.record(id); v != nil {
		for _, c := range v.Consumers {
			out[c.ContainerID] = c.Namespace.Inode != 0
		}
	}
	return out
}

// wantConsumers checks that the journal's consumers of id are exactly the
// containers given, each with its namespace recorded, within 10 s.
func (e *env) wantConsumers(id string, containers ...string) {
	e.t.Helper()
	// A hook that just registered may still be reporting the namespaces
	// of containers that started while it was dead (its synchronize).
	var got map[string]bool
	ok := testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		got = e.consumers(id)
		if len(got) != len(containers) {
			return false
		}
		for _, c := range containers {
			if !got[c] {
				return false
			}
		}
		return true
	})
	if !ok {
		e.t.Fatalf("journal: consumers of %s are %v (container: namespace recorded), want exactly %v, each with its namespace", id, got, containers)
	}
}

// --- containers ---

// fsAt returns the filesystem type and source of the top mount at dir in
// a container, from its /proc/self/mountinfo.
func (e *env) fsAt(ctr, dir string) (fsType, source string) {
	e.t.Helper()
	out, err := e.cri.Exec(ctr, "cat", "/proc/self/mountinfo")
	if err != nil {
		e.t.Fatalf("container %s: %v", ctr, err)
	}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		i := slices.Index(f, "-")
		if len(f) > 4 && f[4] == dir && i > 0 && i+2 < len(f) {
			fsType, source = f[i+1], f[i+2]
		}
	}
	return fsType, source
}

func (e *env) exec(ctr string, script string) string {
	e.t.Helper()
	out, err := e.cri.Exec(ctr, "sh", "-c", script)
	if err != nil {
		e.t.Fatalf("container %s: %s: %v", ctr, script, err)
	}
	return out
}

func (e *env) removeContainer(id string) {
	e.t.Helper()
	if err := e.cri.StopContainer(id); err != nil {
		e.t.Fatal(err)
	}
	if err := e.cri.RemoveContainer(id); err != nil {
		e.t.Fatal(err)
	}
}

func volumeMount(dest, target string, readOnly bool) testutil.ContainerSpec {
	return testutil.ContainerSpec{Mounts: []testutil.CRIMount{{ContainerPath: dest, HostPath: target, Readonly: readOnly}}}
}

// --- a restartable subprocess ---

// proc is a long-running child (the sidecar) that a test may kill and
// start again.
type proc struct {
	t       testing.TB
	name    string
	argv    []string
	logPath string
	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
}

func startProc(t testing.TB, name, logPath string, argv ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, argv: argv, logPath: logPath}
	t.Cleanup(func() {
		p.stop(syscall.SIGTERM)
		if t.Failed() {
			t.Logf("%s log, last lines:\n%s", name, p.tail(60))
		}
	})
	p.start()
	return p
}

func (p *proc) start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	logf, err := os.OpenFile(p.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== start: %s\n", strings.Join(p.argv, " "))
	cmd := exec.Command(p.argv[0], p.argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("starting %s: %v", p.name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.cmd, p.done = cmd, done
}

// signal sends sig without waiting.
func (p *proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	_ = p.cmd.Process.Signal(sig)
}

// stop sends sig (then SIGKILL after 10s) and waits for the exit.
func (p *proc) stop(sig syscall.Signal) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

func (p *proc) log() string { return p.tail(40) }

func (p *proc) tail(n int) string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
