package e2e

// The harness every e2e suite (TestPlugin*, TestPrepare*, TestFuse*, the
// crash test) shares: the real mountplan-plugin binary started with an admin
// config, optionally with a real `mountplan-sidecar serve` as its mounter;
// its CSI and NodePrepare clients; the sidecar's one-shot mount/unmount as
// hack/demo.sh runs them; the journal read from its files. Containers come
// from testutil.StartContainerd. The suites' own helpers (fuse_helpers,
// prepare_helpers, plugin_env) build on it.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/test/testutil"
)

const (
	rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	roo = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY

	ctxEphemeral = "csi.storage.k8s.io/ephemeral"
	miB          = int64(1) << 20
	rpcTimeout   = 60 * time.Second
)

// env is one plugin process (and its mounter, when it has one) and the
// clients talking to it, reporting to t. Copies made by with (for subtests)
// share everything else.
type env struct {
	t *testing.T
	*envShared
}

type envShared struct {
	plugin  *testutil.Plugin
	mounter *mounterProc // nil: the plugin performs plans in process
	sidecar string       // the sidecar binary, for one-shot mount/unmount
	conn    *grpc.ClientConn
	ids     csi.IdentityClient
	ctl     csi.ControllerClient
	node    csi.NodeClient
	np      api.NodePrepareClient
	// dir is the test's temp dir: config, staging paths, targets, the
	// image root.
	dir       string
	imageRoot string // the config's imageRoots entry
	config    string // the admin config file, for the plugin and the mounter
	short     string // a short dir (unix socket paths fit in 108 bytes): the state dir, the mounter's socket
}

// envOptions say how startEnv starts the plugin.
type envOptions struct {
	config  string   // more admin config (YAML) after imageRoots and defaultFsType
	args    []string // more plugin flags (they override the harness's)
	mounter bool     // start `mountplan-sidecar serve` and pass --mounter-endpoint
	// The cgroups the plugin and the mounter are moved into ("": the test's).
	pluginCgroup, mounterCgroup string
}

// startEnv builds the binaries (once per test binary), writes the admin
// config, starts the mounter if asked, then the plugin, and waits until
// Probe is ready. The test must have called testutil.NoLeaks already. A
// cleanup releases whatever a test left staged or published, failing a
// test that passed otherwise.
func startEnv(t *testing.T, o envOptions) *env {
	t.Helper()
	e := newEnv(t, o.config)
	if o.mounter {
		e.startMounter(o.mounterCgroup)
	}
	e.startPlugin(o.pluginCgroup, o.args...)
	return e
}

// newEnv builds the binaries and writes the config (imageRoots: one
// directory under the test's temp dir, defaultFsType ext4, then config); it
// starts nothing.
func newEnv(t *testing.T, config string) *env {
	t.Helper()
	_, sidecar := testutil.BuildBinaries(t)
	e := &env{t: t, envShared: &envShared{sidecar: sidecar, dir: t.TempDir()}}
	e.imageRoot = filepath.Join(e.dir, "images")
	if err := os.Mkdir(e.imageRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	e.config = filepath.Join(e.dir, "config.yaml")
	cfg := fmt.Sprintf("imageRoots: [%q]\ndefaultFsType: ext4\n", e.imageRoot) + config
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	short := testutil.MarkedTempDir(t, "mpenv-")
	t.Cleanup(func() { os.RemoveAll(short) })
	// As /var/lib is on a node: a FUSE daemon of a profile's runAs user
	// (every profile that takes secrets has one) reaches its mount point
	// in the state dir through it.
	if err := os.Chmod(short, 0o711); err != nil {
		t.Fatal(err)
	}
	e.short = short
	return e
}

// stateDir is the plugin's --state-dir (the mounter's --state-dir).
func (e *env) stateDir() string { return filepath.Join(e.short, "state") }

// startPlugin starts the plugin with the config, the state dir, --v=4, the
// mounter's endpoint when there is one, and args, in cgroup ("" for the
// test's own); it connects the clients and waits until Probe is ready.
func (e *env) startPlugin(cgroup string, args ...string) {
	t := e.t
	t.Helper()
	bin, _ := testutil.BuildBinaries(t)
	full := []string{"--node-id", "e2e-node", "--config", e.config, "--state-dir", e.stateDir(), "--v=4"}
	if e.mounter != nil {
		full = append(full, "--mounter-endpoint", e.mounter.endpoint())
	}
	e.plugin = testutil.StartPluginInCgroup(t, bin, cgroup, append(full, args...)...)
	// Registered after StartPlugin's cleanup, so it runs first: whatever a
	// failed test left staged or published is released while the plugin
	// still runs.
	t.Cleanup(e.releaseAll)
	e.connect()
	e.waitReady()
}

func (e *env) connect() {
	e.t.Helper()
	if e.conn != nil {
		e.conn.Close()
	}
	conn, err := endpoint.Dial(e.plugin.Endpoint)
	if err != nil {
		e.t.Fatal(err)
	}
	e.conn = conn
	e.ids, e.ctl, e.node, e.np = csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn), api.NewNodePrepareClient(conn)
}

// restart starts the plugin again (after Kill9 or Stop, or stopping it
// cleanly first), reconnects and waits until Probe is ready.
func (e *env) restart() {
	e.t.Helper()
	e.plugin.Restart()
	e.connect()
	e.waitReady()
}

// waitReady polls Probe until the plugin's startup reconcile has finished.
func (e *env) waitReady() {
	e.t.Helper()
	var last string
	ok := testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		r, err := e.ids.Probe(ctx, &csi.ProbeRequest{})
		last = fmt.Sprintf("ready=%v err=%v", r.GetReady(), err)
		return err == nil && r.GetReady().GetValue()
	})
	if !ok {
		e.t.Fatalf("Probe not ready within 30s: %s", last)
	}
}

// with returns a copy of e whose helpers report to t (a subtest).
func (e *env) with(t *testing.T) *env {
	c := *e
	c.t = t
	return &c
}

// rpcCtx is the context of one call of t: rpcTimeout, canceled at its end.
func rpcCtx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	t.Cleanup(cancel)
	return c
}

func (e *env) ctx() context.Context { return rpcCtx(e.t) }

// releaseAll unpublishes, unstages and deletes every volume that still has a
// record. A test that passed must have done so itself: then any leftover is
// an error.
func (e *env) releaseAll() {
	if e.conn == nil {
		return
	}
	defer e.conn.Close()
	if !e.plugin.Running() {
		return
	}
	for _, id := range e.records() {
		v, err := e.record(id)
		if err != nil {
			continue
		}
		if !e.t.Failed() {
			e.t.Errorf("test left volume %s behind (stage %+v, %d publishes, %d consumers)", id, v.Stage, len(v.Publishes), len(v.Consumers))
		}
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for _, pub := range v.Publishes {
			_, _ = e.node.NodeUnpublishVolume(c, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: pub.TargetPath})
		}
		if v.Stage != nil {
			_, _ = e.node.NodeUnstageVolume(c, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: v.Stage.StagingPath})
		}
		if v.Kind == model.KindProvisioned {
			_, _ = e.ctl.DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: id})
		}
		cancel()
	}
}

// --- capabilities and requests ---

func mountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// create provisions a loop volume of fsType ("": the default) for mount
// access and checks the image the plugin made.
func (e *env) create(name, fsType string, size int64) *csi.Volume {
	e.t.Helper()
	return e.createFor(name, size, mountCap(fsType, rwo))
}

// createFor provisions a loop volume for capability c and checks the image
// the plugin made.
func (e *env) createFor(name string, size int64, c *csi.VolumeCapability) *csi.Volume {
	e.t.Helper()
	params := map[string]string{"type": "loop"}
	if fs := c.GetMount().GetFsType(); fs != "" {
		params["fsType"] = fs
	}
	r, err := e.ctl.CreateVolume(e.ctx(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	if got := r.GetVolume().GetCapacityBytes(); got < size {
		e.t.Fatalf("CreateVolume %s: capacity %d < %d", name, got, size)
	}
	if fi, err := os.Stat(e.image(name)); err != nil || fi.Size() != r.GetVolume().GetCapacityBytes() {
		e.t.Fatalf("image of %s: %v (size %v, want %d)", name, err, fi, r.GetVolume().GetCapacityBytes())
	}
	return r.GetVolume()
}

// delete deletes a provisioned volume and checks that its image and
// record are gone.
func (e *env) delete(id string) {
	e.t.Helper()
	if _, err := e.ctl.DeleteVolume(e.ctx(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		e.t.Fatalf("DeleteVolume %s: %v", id, err)
	}
	if _, err := os.Stat(e.image(id)); !errors.Is(err, fs.ErrNotExist) {
		e.t.Errorf("image of %s still there after DeleteVolume: %v", id, err)
	}
	e.noRecord(id)
}

// image is where the plugin keeps a provisioned volume's image.
func (e *env) image(id string) string {
	return loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
}

// staging returns the staging path of id, made as kubelet makes it.
func (e *env) staging(id string) string {
	p := filepath.Join(e.dir, "staging", id)
	if err := os.MkdirAll(p, 0o750); err != nil {
		e.t.Fatal(err)
	}
	return p
}

// target returns a target path whose parent exists (kubelet makes the
// parent, the plugin the target itself).
func (e *env) target(id, name string) string {
	parent := filepath.Join(e.dir, "pods", id)
	if err := os.MkdirAll(parent, 0o750); err != nil {
		e.t.Fatal(err)
	}
	return filepath.Join(parent, name)
}

func (e *env) tryStage(id string, c *csi.VolumeCapability, vctx, secrets map[string]string) error {
	_, err := e.node.NodeStageVolume(e.ctx(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), VolumeCapability: c, VolumeContext: vctx, Secrets: secrets,
	})
	return err
}

func (e *env) stage(id string, c *csi.VolumeCapability, vctx map[string]string) {
	e.t.Helper()
	if err := e.tryStage(id, c, vctx, nil); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
}

func (e *env) tryUnstage(id string) error {
	_, err := e.node.NodeUnstageVolume(e.ctx(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)})
	return err
}

// unstage unstages id as kubelet does: a volume busy with another
// operation (Aborted: a FUSE supervisor restarting its daemon holds the
// volume's lock) is asked again.
func (e *env) unstage(id string) {
	e.t.Helper()
	if err := testutil.RetryAborted(func() error { return e.tryUnstage(id) }); err != nil {
		e.t.Fatalf("NodeUnstageVolume %s: %v", id, err)
	}
}

func (e *env) publish(id, target string, c *csi.VolumeCapability, readOnly bool, vctx map[string]string) {
	e.t.Helper()
	req := &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: c, Readonly: readOnly, VolumeContext: vctx}
	if vctx[ctxEphemeral] != "true" {
		req.StagingTargetPath = e.staging(id)
	}
	if _, err := e.node.NodePublishVolume(e.ctx(), req); err != nil {
		e.t.Fatalf("NodePublishVolume %s at %s: %v", id, target, err)
	}
}

func (e *env) unpublish(id, target string) {
	e.t.Helper()
	if _, err := e.node.NodeUnpublishVolume(e.ctx(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		e.t.Fatalf("NodeUnpublishVolume %s at %s: %v", id, target, err)
	}
	if isMountPoint(e.t, target) {
		e.t.Errorf("%s still a mount point after NodeUnpublishVolume", target)
	}
	if _, err := os.Lstat(target); !errors.Is(err, fs.ErrNotExist) {
		e.t.Errorf("target %s not removed by NodeUnpublishVolume: %v", target, err)
	}
}

func (e *env) prepare(id string, c *csi.VolumeCapability, pid int, mountPoint string) (*api.NodePrepareVolumeResponse, error) {
	return e.np.NodePrepareVolume(e.ctx(), &api.NodePrepareVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id),
		VolumeCapability: c, Consumer: &api.Consumer{Pid: int64(pid), MountPoint: mountPoint}})
}

func (e *env) unprepare(id string, pid int, mountPoint string, nsInode uint64) error {
	_, err := e.np.NodeUnprepareVolume(e.ctx(), &api.NodeUnprepareVolumeRequest{VolumeId: id,
		Consumer: &api.Consumer{Pid: int64(pid), MountPoint: mountPoint, MntNsInode: nsInode}})
	return err
}

// health returns the abnormal reason of a volume ("" when healthy).
func (e *env) health(id string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		return "", err
	}
	for _, h := range resp.GetVolumeHealth().GetHealthStatuses() {
		return h.GetReason() + ": " + h.GetMessage(), nil
	}
	return "", nil
}

// --- the sidecar's one-shot commands, as a subprocess ---

// runSidecar runs mountplan-sidecar with args and returns its combined
// output and exit status (-1 when it was killed).
func (e *env) runSidecar(args ...string) (string, int) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, e.sidecar, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	start := time.Now()
	err := cmd.Run()
	e.t.Logf("mountplan-sidecar %s (%v): exit %d\n%s", strings.Join(args, " "),
		time.Since(start).Round(time.Millisecond), cmd.ProcessState.ExitCode(), strings.TrimSpace(out.String()))
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		e.t.Fatalf("running mountplan-sidecar: %v", err)
	}
	return out.String(), cmd.ProcessState.ExitCode()
}

// sidecarMount runs `mountplan-sidecar mount` as hack/demo.sh does.
func (e *env) sidecarMount(id string, pid int, target string, extra ...string) (string, int) {
	e.t.Helper()
	args := append([]string{"mount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--staging-path", e.staging(id), "--pid", strconv.Itoa(pid), "--target", target,
		"--state-dir", e.stateDir()}, extra...)
	return e.runSidecar(args...)
}

func (e *env) mustSidecarMount(id string, pid int, target string, extra ...string) {
	e.t.Helper()
	if out, code := e.sidecarMount(id, pid, target, extra...); code != 0 {
		e.t.Fatalf("mountplan-sidecar mount exited %d:\n%s", code, out)
	}
}

func (e *env) sidecarUnmount(id string, pid int, target string, extra ...string) (string, int) {
	e.t.Helper()
	args := append([]string{"unmount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--pid", strconv.Itoa(pid), "--target", target}, extra...)
	return e.runSidecar(args...)
}

func (e *env) mustSidecarUnmount(id string, pid int, target string, extra ...string) {
	e.t.Helper()
	if out, code := e.sidecarUnmount(id, pid, target, extra...); code != 0 {
		e.t.Fatalf("mountplan-sidecar unmount exited %d:\n%s", code, out)
	}
}

// --- the mounter: `mountplan-sidecar serve` ---

// mounterProc is a `mountplan-sidecar serve` subprocess.
type mounterProc struct {
	cmd     *exec.Cmd
	done    chan struct{}
	socket  string
	logPath string
}

func (m *mounterProc) endpoint() string { return "unix://" + m.socket }
func (m *mounterProc) pid() int         { return m.cmd.Process.Pid }

func (m *mounterProc) log() string {
	b, _ := os.ReadFile(m.logPath)
	return string(b)
}

// startMounter starts `mountplan-sidecar serve` with the env's config and
// its state dir as the allowed root, in cgroup ("" for the test's own),
// and waits until it listens; the plugin started next uses it. Called
// again (after a kill), it starts a new one on the same socket and log. A
// cleanup kills it and logs its log when the test failed.
func (e *env) startMounter(cgroup string, args ...string) *mounterProc {
	t := e.t
	t.Helper()
	m := &mounterProc{done: make(chan struct{}), socket: filepath.Join(e.short, "mounter.sock"), logPath: filepath.Join(e.short, "mounter.log")}
	logf, err := os.OpenFile(m.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	// --kubelet-dir as testutil gives the plugin: publishes land below it.
	m.cmd = exec.Command(e.sidecar, append([]string{"serve", "--endpoint", m.endpoint(), "--state-dir", e.stateDir(),
		"--config", e.config, "--kubelet-dir", os.TempDir(), "--v=4"}, args...)...)
	m.cmd.Stdout, m.cmd.Stderr = logf, logf
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if cgroup != "" {
		if err := testutil.JoinCgroup(cgroup, m.pid()); err != nil {
			_ = m.cmd.Process.Kill()
			_ = m.cmd.Wait()
			t.Fatalf("moving the mounter into %s: %v", cgroup, err)
		}
	}
	go func() { _ = m.cmd.Wait(); close(m.done) }()
	t.Cleanup(func() {
		select {
		case <-m.done:
		default:
			_ = m.cmd.Process.Kill()
			<-m.done
		}
		if t.Failed() {
			t.Logf("mountplan-sidecar serve log:\n%s", m.log())
		}
	})
	if !testutil.Poll(10*time.Second, 10*time.Millisecond, func() bool {
		select {
		case <-m.done:
			return true
		default:
		}
		c, err := net.DialTimeout("unix", m.socket, time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	}) {
		t.Fatalf("mountplan-sidecar serve did not listen on %s within 10s:\n%s", m.socket, m.log())
	}
	select {
	case <-m.done:
		t.Fatalf("mountplan-sidecar serve exited at start (%v):\n%s", m.cmd.ProcessState, m.log())
	default:
	}
	e.mounter = m
	return m
}

// kill9 kills the mounter with SIGKILL, as a crash would, and waits until
// it is gone.
func (m *mounterProc) kill9() {
	_ = m.cmd.Process.Kill()
	<-m.done
}

// stop sends SIGTERM and returns the exit status.
func (m *mounterProc) stop(t *testing.T) int {
	t.Helper()
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		t.Fatal("mountplan-sidecar serve ignored SIGTERM for 10s")
	}
	return m.cmd.ProcessState.ExitCode()
}

// --- the journal, read from its files ---

func (e *env) recordPath(id string) string { return filepath.Join(e.stateDir(), "volumes", id+".json") }

// record reads id's journal record straight from its file. The plugin
// rewrites runtime records in place, so a read can meet a write half done:
// that one is read again (the plugin's own readers never read the file).
func (e *env) record(id string) (*model.Volume, error) {
	var err error
	for range 50 {
		var b []byte
		if b, err = os.ReadFile(e.recordPath(id)); err != nil {
			return nil, err
		}
		v := &model.Volume{}
		if err = json.Unmarshal(b, v); err == nil {
			return v, nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil, err
}

func (e *env) mustRecord(id string) *model.Volume {
	e.t.Helper()
	v, err := e.record(id)
	if err != nil {
		e.t.Fatalf("record of %s: %v", id, err)
	}
	return v
}

// noRecord fails the test if id still has a record.
func (e *env) noRecord(id string) {
	e.t.Helper()
	if _, err := os.Stat(e.recordPath(id)); !errors.Is(err, fs.ErrNotExist) {
		b, _ := os.ReadFile(e.recordPath(id))
		e.t.Errorf("record of %s still there: %v %s", id, err, b)
	}
}

// records lists the IDs that have a record.
func (e *env) records() []string {
	ents, err := os.ReadDir(filepath.Join(e.stateDir(), "volumes"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.t.Fatal(err)
	}
	var ids []string
	for _, ent := range ents {
		if id, ok := strings.CutSuffix(ent.Name(), ".json"); ok && !strings.HasPrefix(id, ".") {
			ids = append(ids, id)
		}
	}
	return ids
}

// editRecord rewrites a record as raw JSON (the plugin must not be running).
func (e *env) editRecord(id string, edit func(m map[string]any)) {
	e.t.Helper()
	if e.plugin.Running() {
		e.t.Fatal("editRecord while the plugin runs")
	}
	b, err := os.ReadFile(e.recordPath(id))
	if err != nil {
		e.t.Fatal(err)
	}
	m := map[string]any{}
	if err := json.Unmarshal(b, &m); err != nil {
		e.t.Fatal(err)
	}
	edit(m)
	if b, err = json.Marshal(m); err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(e.recordPath(id), b, 0o600); err != nil {
		e.t.Fatal(err)
	}
}

// loopState is the loop source's part of a staged record.
func (e *env) loopState(id string) loop.State {
	e.t.Helper()
	v := e.mustRecord(id)
	if v.Stage == nil || v.Stage.Phase != model.PhaseStaged {
		e.t.Fatalf("volume %s not staged in its record: %+v", id, v.Stage)
	}
	var st loop.State
	if err := json.Unmarshal(v.Stage.Source, &st); err != nil {
		e.t.Fatalf("record of %s: loop state: %v", id, err)
	}
	return st
}

// consumers returns the consumers the journal records for id.
func (e *env) consumers(id string) []model.Claim {
	e.t.Helper()
	v, err := e.record(id)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		e.t.Fatalf("record of %s: %v", id, err)
	}
	return v.Consumers
}
