package e2e

// Helpers of the TestPlugin* tests: the real mountplan-plugin binary on its
// unix socket, CSI gRPC clients, and independent views of the kernel
// (sysfs, mountinfo) and of the plugin's journal files.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	"github.com/mountplan/mountplan/pkg/endpoint"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

const (
	plugRWO = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	plugROO = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY

	plugCtxEphemeral = "csi.storage.k8s.io/ephemeral"
	plugMiB          = int64(1) << 20
	plugRPCTimeout   = 60 * time.Second
)

// plugEnv is one plugin process and the clients talking to it, reporting to t.
// Copies made by with (for subtests) share the plugin and the clients.
type plugEnv struct {
	t *testing.T
	*plugShared
}

type plugShared struct {
	p     *testutil.Plugin
	conn  *grpc.ClientConn
	ids   csi.IdentityClient
	ctl   csi.ControllerClient
	node  csi.NodeClient
	dir   string // the test's temp dir: targets, staging paths, config, image root
	root  string // the imageRoots entry of the config
	state string // the plugin's --state-dir
}

// startPlugEnv builds the plugin (once), writes its config (imageRoots: one
// directory under the test's temp dir), starts it with args and waits until
// Probe is ready. The test must have called testutil.NoLeaks already.
func startPlugEnv(t *testing.T, args ...string) *plugEnv {
	t.Helper()
	bin, err := testutil.BuildOnce(testutil.PluginPackage)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "images")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("imageRoots: ["+root+"]\ndefaultFsType: ext4\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := testutil.StartPlugin(t, bin, append([]string{"--node-id", "e2e-node", "--config", cfg}, args...)...)
	e := &plugEnv{t: t, plugShared: &plugShared{p: p, dir: dir, root: root, state: p.StateDir}}
	// Registered after StartPlugin's cleanup, so it runs first: whatever a
	// failed test left staged or published is released while the plugin
	// still runs.
	t.Cleanup(e.releaseAll)
	e.connect()
	e.waitReady()
	return e
}

func (e *plugEnv) connect() {
	e.t.Helper()
	if e.conn != nil {
		e.conn.Close()
	}
	conn, err := endpoint.Dial(e.p.Endpoint)
	if err != nil {
		e.t.Fatal(err)
	}
	e.conn = conn
	e.ids, e.ctl, e.node = csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)
}

// restart starts the plugin again (after Kill9 or Stop, or stopping it
// cleanly first), reconnects and waits until Probe is ready.
func (e *plugEnv) restart() {
	e.t.Helper()
	e.p.Restart()
	e.connect()
	e.waitReady()
}

func (e *plugEnv) waitReady() {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		r, err := e.ids.Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && r.GetReady().GetValue() {
			return
		}
		last = fmt.Sprintf("ready=%v err=%v", r.GetReady(), err)
		time.Sleep(20 * time.Millisecond)
	}
	e.t.Fatalf("Probe not ready within 30s: %s", last)
}

func plugCtx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), plugRPCTimeout)
	t.Cleanup(cancel)
	return c
}

// releaseAll unpublishes, unstages and deletes every volume that still has a
// record. A test that passed must have done so itself: then any leftover is
// an error.
func (e *plugEnv) releaseAll() {
	if e.conn == nil {
		return
	}
	defer e.conn.Close()
	if !e.p.Running() {
		return
	}
	ents, _ := os.ReadDir(filepath.Join(e.state, "volumes"))
	for _, ent := range ents {
		id, ok := strings.CutSuffix(ent.Name(), ".json")
		if !ok || strings.HasPrefix(id, ".") {
			continue
		}
		v, err := e.record(id)
		if err != nil {
			continue
		}
		if !e.t.Failed() {
			e.t.Errorf("test left volume %s behind (stage %+v, %d publishes)", id, v.Stage, len(v.Publishes))
		}
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for _, pub := range v.Publishes {
			_, _ = e.node.NodeUnpublishVolume(c, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: pub.TargetPath})
		}
		if v.Stage != nil {
			_, _ = e.node.NodeUnstageVolume(c, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: v.Stage.StagingPath})
		}
		if v.Kind == journal.KindProvisioned {
			_, _ = e.ctl.DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: id})
		}
		cancel()
	}
}

// --- capabilities and requests ---

func plugMountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func plugBlockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// create provisions a volume and checks the image the plugin made.
func (e *plugEnv) create(name, fsType string, size int64) *csi.Volume {
	e.t.Helper()
	r, err := e.ctl.CreateVolume(plugCtx(e.t), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{plugMountCap(fsType, plugRWO)},
		Parameters:         map[string]string{"type": "loop", "fsType": fsType},
	})
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

func (e *plugEnv) delete(id string) {
	e.t.Helper()
	if _, err := e.ctl.DeleteVolume(plugCtx(e.t), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		e.t.Fatalf("DeleteVolume %s: %v", id, err)
	}
	if _, err := os.Stat(e.image(id)); !errors.Is(err, fs.ErrNotExist) {
		e.t.Errorf("image of %s still there after DeleteVolume: %v", id, err)
	}
	e.noRecord(id)
}

// image is where the plugin keeps a provisioned volume's image.
func (e *plugEnv) image(id string) string {
	return loop.ImagePath(e.state, journal.KindProvisioned, id)
}

func (e *plugEnv) staging(id string) string {
	p := filepath.Join(e.dir, "staging", id)
	if err := os.MkdirAll(p, 0o750); err != nil {
		e.t.Fatal(err)
	}
	return p
}

// target returns a target path whose parent exists (kubelet makes the
// parent, the plugin the target itself).
func (e *plugEnv) target(id, name string) string {
	parent := filepath.Join(e.dir, "pods", id)
	if err := os.MkdirAll(parent, 0o750); err != nil {
		e.t.Fatal(err)
	}
	return filepath.Join(parent, name)
}

func (e *plugEnv) tryStage(id string, c *csi.VolumeCapability, vctx, secrets map[string]string) error {
	_, err := e.node.NodeStageVolume(plugCtx(e.t), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), VolumeCapability: c, VolumeContext: vctx, Secrets: secrets,
	})
	return err
}

func (e *plugEnv) stage(id string, c *csi.VolumeCapability, vctx map[string]string) {
	e.t.Helper()
	if err := e.tryStage(id, c, vctx, nil); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
}

func (e *plugEnv) unstage(id string) {
	e.t.Helper()
	if _, err := e.node.NodeUnstageVolume(plugCtx(e.t), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)}); err != nil {
		e.t.Fatalf("NodeUnstageVolume %s: %v", id, err)
	}
}

func (e *plugEnv) publish(id, target string, c *csi.VolumeCapability, readOnly bool, vctx map[string]string) {
	e.t.Helper()
	req := &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: c, Readonly: readOnly, VolumeContext: vctx}
	if vctx[plugCtxEphemeral] != "true" {
		req.StagingTargetPath = e.staging(id)
	}
	if _, err := e.node.NodePublishVolume(plugCtx(e.t), req); err != nil {
		e.t.Fatalf("NodePublishVolume %s at %s: %v", id, target, err)
	}
}

func (e *plugEnv) unpublish(id, target string) {
	e.t.Helper()
	if _, err := e.node.NodeUnpublishVolume(plugCtx(e.t), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		e.t.Fatalf("NodeUnpublishVolume %s at %s: %v", id, target, err)
	}
	if plugIsMountPoint(e.t, target) {
		e.t.Errorf("%s still a mount point after NodeUnpublishVolume", target)
	}
	if _, err := os.Lstat(target); !errors.Is(err, fs.ErrNotExist) {
		e.t.Errorf("target %s not removed by NodeUnpublishVolume: %v", target, err)
	}
}

// --- the journal, read as files ---

func (e *plugEnv) recordPath(id string) string { return filepath.Join(e.state, "volumes", id+".json") }

func (e *plugEnv) record(id string) (*journal.Volume, error) {
	b, err := os.ReadFile(e.recordPath(id))
	if err != nil {
		return nil, err
	}
	v := &journal.Volume{}
	return v, json.Unmarshal(b, v)
}

func (e *plugEnv) mustRecord(id string) *journal.Volume {
	e.t.Helper()
	v, err := e.record(id)
	if err != nil {
		e.t.Fatalf("record of %s: %v", id, err)
	}
	return v
}

func (e *plugEnv) noRecord(id string) {
	e.t.Helper()
	if _, err := os.Stat(e.recordPath(id)); !errors.Is(err, fs.ErrNotExist) {
		b, _ := os.ReadFile(e.recordPath(id))
		e.t.Errorf("record of %s still there: %v %s", id, err, b)
	}
}

// records lists the IDs that have a record.
func (e *plugEnv) records() []string {
	ents, err := os.ReadDir(filepath.Join(e.state, "volumes"))
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
func (e *plugEnv) editRecord(id string, edit func(m map[string]any)) {
	e.t.Helper()
	if e.p.Running() {
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
func (e *plugEnv) loopState(id string) loop.State {
	e.t.Helper()
	v := e.mustRecord(id)
	if v.Stage == nil || v.Stage.Phase != journal.PhaseStaged {
		e.t.Fatalf("volume %s not staged in its record: %+v", id, v.Stage)
	}
	var st loop.State
	if err := json.Unmarshal(v.Stage.Source, &st); err != nil {
		e.t.Fatalf("record of %s: loop state: %v", id, err)
	}
	return st
}

// --- the kernel's view ---

// plugLoop is a bound loop device as sysfs shows it.
type plugLoop struct {
	Name    string // loop3
	Dev     string // 7:3
	Backing string
}

func (l plugLoop) Path() string { return "/dev/" + l.Name }

func plugSysfs(name, file string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", name, file))
	return strings.TrimSpace(string(b)), err
}

// plugLoopsBackedBy lists the bound loop devices whose backing file is path.
func plugLoopsBackedBy(t *testing.T, path string) []plugLoop {
	t.Helper()
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		real = path
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []plugLoop
	for _, f := range files {
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		b, err := plugSysfs(name, "loop/backing_file")
		if err != nil || (b != real && b != path) {
			continue
		}
		dev, err := plugSysfs(name, "dev")
		if err != nil {
			continue
		}
		out = append(out, plugLoop{Name: name, Dev: dev, Backing: b})
	}
	return out
}

// plugOneLoop asserts that exactly one loop device is backed by image and
// returns it.
func plugOneLoop(t *testing.T, image string) plugLoop {
	t.Helper()
	ls := plugLoopsBackedBy(t, image)
	if len(ls) != 1 {
		t.Fatalf("%d loop devices backed by %s, want 1: %+v", len(ls), image, ls)
	}
	return ls[0]
}

// plugWaitNoLoop waits (the kernel may release a device a moment after the
// last close) until no loop device is backed by image.
func plugWaitNoLoop(t *testing.T, image string) {
	t.Helper()
	var ls []plugLoop
	if !testutil.Poll(5*time.Second, 20*time.Millisecond, func() bool {
		ls = plugLoopsBackedBy(t, image)
		return len(ls) == 0
	}) {
		t.Fatalf("loop devices still backed by %s: %+v", image, ls)
	}
}

// checkStagedLoop checks the record of a staged volume against sysfs: the
// recorded device is bound to the image, with autoclear, and it is the only
// one. It returns the device.
func (e *plugEnv) checkStagedLoop(id, image string) plugLoop {
	e.t.Helper()
	st := e.loopState(id)
	l := plugOneLoop(e.t, image)
	if st.Device != l.Path() {
		e.t.Fatalf("record of %s names %s, but %s is the device backed by %s", id, st.Device, l.Path(), image)
	}
	if want := fmt.Sprintf("%d:%d", st.Identity.Major, st.Identity.Minor); want != l.Dev {
		e.t.Errorf("record of %s: identity %s, sysfs %s", id, want, l.Dev)
	}
	var fi unix.Stat_t
	if err := unix.Stat(image, &fi); err != nil {
		e.t.Fatal(err)
	}
	if st.Identity.BackingIno != fi.Ino || st.Identity.BackingDev != uint64(fi.Dev) { //nolint:unconvert
		e.t.Errorf("record of %s: backing %d:%d, image is %d:%d", id, st.Identity.BackingDev, st.Identity.BackingIno, fi.Dev, fi.Ino)
	}
	if ac, _ := plugSysfs(l.Name, "loop/autoclear"); ac != "1" {
		e.t.Errorf("%s: autoclear=%q, want 1", l.Path(), ac)
	}
	return l
}

// plugMountsOf returns the mounts of pid's namespace that use device dev
// ("major:minor").
func plugMountsOf(t *testing.T, pid int, dev string) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	infos, err := mountinfo.GetMountsFromReader(bytes.NewReader(b), nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, i := range infos {
		if fmt.Sprintf("%d:%d", i.Major, i.Minor) == dev {
			out = append(out, i.Mountpoint)
		}
	}
	return out
}

// notMounted asserts that l is mounted nowhere, neither in this process's
// mount namespace nor in the plugin's.
func (e *plugEnv) notMounted(l plugLoop) {
	e.t.Helper()
	for _, pid := range []int{os.Getpid(), e.p.PID()} {
		if m := plugMountsOf(e.t, pid, l.Dev); len(m) > 0 {
			e.t.Errorf("%s (%s) is mounted at %v in the mountinfo of pid %d; staging must not mount", l.Path(), l.Dev, m, pid)
		}
	}
}

func plugIsMountPoint(t *testing.T, p string) bool {
	t.Helper()
	m, err := mountinfo.Mounted(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("mountinfo.Mounted(%s): %v", p, err)
	}
	return m
}

// plugMountOptions returns the per-mount options of the mount at p.
func plugMountOptions(t *testing.T, p string) string {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
	if err != nil || len(infos) == 0 {
		t.Fatalf("no mount at %s: %v", p, err)
	}
	return infos[len(infos)-1].Options
}

func plugStatfsTotal(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * uint64(st.Bsize)
}

func plugWriteFile(t *testing.T, p, content string) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	if _, err := f.WriteString(content); err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync %s: %v", p, err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func plugReadFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("read %s: %v", p, err)
	}
	return string(b)
}

func plugRun(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// plugMkfsExt4Image makes an ext4 image of size bytes at path holding the files
// of content (name → data), with mkfs.ext4 -d: no mount needed.
func plugMkfsExt4Image(t *testing.T, path string, size int64, content map[string]string) {
	t.Helper()
	src := t.TempDir()
	for name, data := range content {
		if err := os.WriteFile(filepath.Join(src, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	plugRun(t, "mkfs.ext4", "-q", "-F", "-d", src, path)
}

// plugCapEff reports whether pid has capability bit in its effective set.
func plugCapEff(t *testing.T, pid int, bit uint) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var v uint64
			if _, err := fmt.Sscanf(strings.TrimSpace(hex), "%x", &v); err != nil {
				t.Fatal(err)
			}
			return v&(1<<bit) != 0
		}
	}
	t.Fatalf("no CapEff in /proc/%d/status", pid)
	return false
}

// with returns a copy of e whose helpers report to t (a subtest).
func (e *plugEnv) with(t *testing.T) *plugEnv {
	c := *e
	c.t = t
	return &c
}
