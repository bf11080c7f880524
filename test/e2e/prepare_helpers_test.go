package e2e

// Helpers of the TestPrepare* tests (prepare-not-publish, issue 3): the real
// mountplan-plugin binary started with an admin config, the real
// mountplan-sidecar run as a subprocess exactly as hack/demo.sh runs it, CSI
// and NodePrepare gRPC clients, and views of the kernel that do not go
// through the product: /proc/*/mountinfo, /sys/block/loop*, the journal's
// files. Every name here starts with "prep" so that it cannot clash with the
// helpers of the TestPlugin* tests in the same package.

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
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/endpoint"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

const (
	prepRWO        = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	prepRPCTimeout = 60 * time.Second
	prepMiB        = int64(1) << 20
)

// prepEnv is one plugin process, the clients that talk to it and the path of
// the sidecar binary.
type prepEnv struct {
	t         *testing.T
	plugin    *testutil.Plugin
	sidecar   string
	conn      *grpc.ClientConn
	ids       csi.IdentityClient
	ctl       csi.ControllerClient
	node      csi.NodeClient
	np        api.NodePrepareClient
	dir       string // the test's temp dir: config, staging paths, targets
	imageRoot string // the config's imageRoots entry ("" when none)
}

type prepOptions struct {
	imageRoot bool     // make an image root and allow it in the config
	args      []string // more plugin flags
}

// startPrepEnv builds the binaries (once per test binary), writes the
// admin config, starts the plugin with it and waits until Probe is ready.
func startPrepEnv(t *testing.T, o prepOptions) *prepEnv {
	t.Helper()
	pluginBin, sidecarBin := testutil.BuildBinaries(t)
	e := &prepEnv{t: t, sidecar: sidecarBin, dir: t.TempDir()}
	cfg := "defaultFsType: ext4\n"
	if o.imageRoot {
		e.imageRoot = filepath.Join(e.dir, "images")
		if err := os.Mkdir(e.imageRoot, 0o755); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("imageRoots: [%q]\n", e.imageRoot)
	}
	cfgPath := filepath.Join(e.dir, "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	e.plugin = testutil.StartPlugin(t, pluginBin, append([]string{"--config", cfgPath, "--v=4"}, o.args...)...)
	conn, err := endpoint.Dial(e.plugin.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.conn = conn
	e.ids = csi.NewIdentityClient(conn)
	e.ctl = csi.NewControllerClient(conn)
	e.node = csi.NewNodeClient(conn)
	e.np = api.NewNodePrepareClient(conn)
	e.waitReady()
	return e
}

// waitReady polls Probe until the plugin's startup reconcile has finished.
func (e *prepEnv) waitReady() {
	e.t.Helper()
	var last error
	ok := testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		resp, err := e.ids.Probe(ctx, &csi.ProbeRequest{})
		last = err
		return err == nil && resp.GetReady().GetValue()
	})
	if !ok {
		e.t.Fatalf("plugin not ready within 30s (last error %v)", last)
	}
}

func (e *prepEnv) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), prepRPCTimeout)
	e.t.Cleanup(cancel)
	return ctx
}

func (e *prepEnv) stateDir() string { return e.plugin.StateDir }

// with returns a copy of e that reports to t (a subtest).
func (e *prepEnv) with(t *testing.T) *prepEnv {
	c := *e
	c.t = t
	return &c
}

// --- CSI and NodePrepare calls ---

func prepMountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: prepRWO},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
}

func prepBlockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: prepRWO},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
}

// create provisions a loop volume of size bytes for mount access and
// returns its ID.
func (e *prepEnv) create(name string, size int64) string {
	e.t.Helper()
	return e.createFor(name, size, prepMountCap())
}

// createFor provisions a loop volume for capability c.
func (e *prepEnv) createFor(name string, size int64, c *csi.VolumeCapability) string {
	e.t.Helper()
	resp, err := e.ctl.CreateVolume(e.ctx(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		Parameters:         map[string]string{"type": "loop"},
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume().GetVolumeId()
}

func (e *prepEnv) delete(id string) {
	e.t.Helper()
	if _, err := e.ctl.DeleteVolume(e.ctx(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		e.t.Fatalf("DeleteVolume %s: %v", id, err)
	}
}

// staging returns a staging path for id (the plugin mounts nothing there).
func (e *prepEnv) staging(id string) string { return filepath.Join(e.dir, "staging", id) }

func (e *prepEnv) tryStage(id string, c *csi.VolumeCapability, vctx map[string]string) error {
	_, err := e.node.NodeStageVolume(e.ctx(), &csi.NodeStageVolumeRequest{VolumeId: id,
		StagingTargetPath: e.staging(id), VolumeCapability: c, VolumeContext: vctx})
	return err
}

func (e *prepEnv) stage(id string, c *csi.VolumeCapability, vctx map[string]string) {
	e.t.Helper()
	if err := e.tryStage(id, c, vctx); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
}

func (e *prepEnv) tryUnstage(id string) error {
	_, err := e.node.NodeUnstageVolume(e.ctx(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)})
	return err
}

func (e *prepEnv) unstage(id string) {
	e.t.Helper()
	if err := e.tryUnstage(id); err != nil {
		e.t.Fatalf("NodeUnstageVolume %s: %v", id, err)
	}
}

func (e *prepEnv) prepare(id string, c *csi.VolumeCapability, pid int, mountPoint string) (*api.NodePrepareVolumeResponse, error) {
	return e.np.NodePrepareVolume(e.ctx(), &api.NodePrepareVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id),
		VolumeCapability: c, Consumer: &api.Consumer{Pid: int64(pid), MountPoint: mountPoint}})
}

func (e *prepEnv) unprepare(id string, pid int, mountPoint string, nsInode uint64) error {
	_, err := e.np.NodeUnprepareVolume(e.ctx(), &api.NodeUnprepareVolumeRequest{VolumeId: id,
		Consumer: &api.Consumer{Pid: int64(pid), MountPoint: mountPoint, MntNsInode: nsInode}})
	return err
}

// --- the sidecar, as a subprocess ---

// runSidecar runs mountplan-sidecar with args and returns its combined
// output and exit status (-1 when it did not run or was killed).
func (e *prepEnv) runSidecar(args ...string) (string, int) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), prepRPCTimeout)
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
func (e *prepEnv) sidecarMount(id string, pid int, target string, extra ...string) (string, int) {
	e.t.Helper()
	args := append([]string{"mount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--staging-path", e.staging(id), "--pid", strconv.Itoa(pid), "--target", target,
		"--allowed-root", e.stateDir()}, extra...)
	return e.runSidecar(args...)
}

func (e *prepEnv) mustSidecarMount(id string, pid int, target string, extra ...string) {
	e.t.Helper()
	if out, code := e.sidecarMount(id, pid, target, extra...); code != 0 {
		e.t.Fatalf("mountplan-sidecar mount exited %d:\n%s", code, out)
	}
}

func (e *prepEnv) sidecarUnmount(id string, pid int, target string, extra ...string) (string, int) {
	e.t.Helper()
	args := append([]string{"unmount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--pid", strconv.Itoa(pid), "--target", target}, extra...)
	return e.runSidecar(args...)
}

func (e *prepEnv) mustSidecarUnmount(id string, pid int, target string, extra ...string) {
	e.t.Helper()
	if out, code := e.sidecarUnmount(id, pid, target, extra...); code != 0 {
		e.t.Fatalf("mountplan-sidecar unmount exited %d:\n%s", code, out)
	}
}

// --- the journal, read from its files ---

func (e *prepEnv) recordPath(id string) string {
	return filepath.Join(e.stateDir(), "volumes", id+".json")
}

// record reads the journal file of id; nil when there is none.
func (e *prepEnv) record(id string) *journal.Volume {
	e.t.Helper()
	b, err := os.ReadFile(e.recordPath(id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	v := &journal.Volume{}
	if err := json.Unmarshal(b, v); err != nil {
		e.t.Fatalf("journal record %s: %v\n%s", id, err, b)
	}
	return v
}

func (e *prepEnv) mustRecord(id string) *journal.Volume {
	e.t.Helper()
	v := e.record(id)
	if v == nil {
		e.t.Fatalf("no journal record for volume %s", id)
	}
	return v
}

func (e *prepEnv) loopState(id string) loop.State {
	e.t.Helper()
	v := e.mustRecord(id)
	if v.Stage == nil {
		e.t.Fatalf("journal: volume %s is not staged", id)
	}
	var st loop.State
	if err := json.Unmarshal(v.Stage.Source, &st); err != nil {
		e.t.Fatalf("journal: volume %s: loop state: %v", id, err)
	}
	return st
}

// consumers returns the consumers the journal records for id.
func (e *prepEnv) consumers(id string) []journal.Claim {
	e.t.Helper()
	v := e.record(id)
	if v == nil {
		return nil
	}
	return v.Consumers
}

// wantConsumer checks that the journal records exactly one consumer of id:
// pid's mount namespace (by inode, not only by PID) at mountPoint.
func (e *prepEnv) wantConsumer(id string, pid int, mountPoint string) journal.Claim {
	e.t.Helper()
	cs := e.consumers(id)
	if len(cs) != 1 {
		e.t.Fatalf("journal: volume %s has %d consumers, want 1: %+v", id, len(cs), cs)
	}
	c := cs[0]
	ino := prepNSInode(e.t, pid)
	if c.PID != pid || c.MountPoint != mountPoint || c.Namespace.Inode != ino {
		e.t.Fatalf("journal: consumer %+v, want pid %d mnt ns %d at %s", c, pid, ino, mountPoint)
	}
	return c
}

func (e *prepEnv) wantNoConsumer(id string) {
	e.t.Helper()
	if cs := e.consumers(id); len(cs) != 0 {
		e.t.Errorf("journal: volume %s still records consumers %+v", id, cs)
	}
}

// --- the kernel's view ---

// prepDev is a loop device: its node and number.
type prepDev struct {
	Path         string // /dev/loopN
	Major, Minor uint32
}

func (d prepDev) name() string   { return filepath.Base(d.Path) }
func (d prepDev) String() string { return fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor) }

func prepDevOf(t *testing.T, path string) prepDev {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("%s is not a block device", path)
	}
	return prepDev{Path: path, Major: unix.Major(uint64(st.Rdev)), Minor: unix.Minor(uint64(st.Rdev))} //nolint:unconvert
}

// stagedDevice returns the loop device of a staged volume and checks, in
// sysfs, that it is backed by image.
func (e *prepEnv) stagedDevice(id, image string) prepDev {
	e.t.Helper()
	st := e.loopState(id)
	d := prepDevOf(e.t, st.Device)
	if got := prepBackingFile(d.name()); got != image {
		e.t.Fatalf("%s is backed by %q, want %q", d, got, image)
	}
	return d
}

func prepBackingFile(name string) string {
	b, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// prepLoopsBackedBy lists the loop devices whose backing file is image.
func prepLoopsBackedBy(image string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		bf := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
		if bf == image {
			out = append(out, filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

// prepWaitNoLoop waits (the kernel detaches an autoclear device at its last
// close, which may lag) until no loop device is backed by image.
func prepWaitNoLoop(t *testing.T, image string) {
	t.Helper()
	var left []string
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
		left = prepLoopsBackedBy(image)
		return len(left) == 0
	}) {
		t.Errorf("loop devices %v still backed by %s", left, image)
	}
}

// prepMountsOfDev returns the mounts in pid's mount table that show d: a
// filesystem on it (its major:minor, or its path as the source) or a bind
// of its device node (a devtmpfs mount whose root is the node).
func prepMountsOfDev(pid int, d prepDev) ([]string, error) {
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, mi := range infos {
		if (uint32(mi.Major) == d.Major && uint32(mi.Minor) == d.Minor) || mi.Source == d.Path ||
			(mi.Root == "/"+d.name() && mi.FSType == "devtmpfs") {
			out = append(out, fmt.Sprintf("%s (%s %s %d:%d root %s)", mi.Mountpoint, mi.FSType, mi.Source, mi.Major, mi.Minor, mi.Root))
		}
	}
	return out, nil
}

// prepHostMountsOfDev: the test runs in the host's mount namespace, as does
// the plugin; /proc/self/mountinfo is the host's table.
func prepHostMountsOfDev(t *testing.T, d prepDev) []string {
	t.Helper()
	out, err := prepMountsOfDev(os.Getpid(), d)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// prepCheckHostClean fails t if the host namespace shows d mounted.
func prepCheckHostClean(t *testing.T, when string, d prepDev) {
	t.Helper()
	if m := prepHostMountsOfDev(t, d); len(m) > 0 {
		t.Errorf("%s: the host's /proc/self/mountinfo shows %s mounted: %v", when, d, m)
	}
}

// prepNamespacesShowing returns, per mount namespace, a live process of it
// whose mount table shows d.
func prepNamespacesShowing(d prepDev) map[string]int {
	out := map[string]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ns, err := testutil.MountNamespaceOf(pid)
		if err != nil {
			continue
		}
		if _, seen := out[ns]; seen {
			continue
		}
		if m, err := prepMountsOfDev(pid, d); err == nil && len(m) > 0 {
			out[ns] = pid
		}
	}
	return out
}

// prepNSInode returns the inode of pid's mount namespace.
func prepNSInode(t *testing.T, pid int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/mnt", pid), &st); err != nil {
		t.Fatalf("mount namespace of %d: %v", pid, err)
	}
	return st.Ino
}

// prepMountAt returns the mount at mountPoint in pid's table (the topmost
// one), or nil.
func prepMountAt(t *testing.T, pid int, mountPoint string) *mountinfo.Info {
	t.Helper()
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	var top *mountinfo.Info
	for _, mi := range infos {
		if mi.Mountpoint == mountPoint {
			top = mi
		}
	}
	return top
}

// prepWatch polls the host's mount table in the background for as long as
// the test runs and records every mount that bad says must not be there:
// "never" checked continuously, not only at chosen points.
type prepWatch struct {
	mu    sync.Mutex
	seen  map[string]bool
	polls int
	once  sync.Once
	stop  chan struct{}
	done  chan struct{}
}

func prepWatchHost(t *testing.T, what string, bad func(*mountinfo.Info) bool) *prepWatch {
	w := &prepWatch{seen: map[string]bool{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			infos, err := mountinfo.GetMounts(nil)
			w.mu.Lock()
			w.polls++
			if err == nil {
				for _, mi := range infos {
					if bad(mi) {
						w.seen[fmt.Sprintf("%s (%s %s %d:%d %s)", mi.Mountpoint, mi.FSType, mi.Source, mi.Major, mi.Minor, mi.VFSOptions)] = true
					}
				}
			}
			w.mu.Unlock()
			select {
			case <-w.stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { w.check(t, what) })
	return w
}

// check stops the watch and fails t if it saw anything. Only the first
// call checks.
func (w *prepWatch) check(t *testing.T, what string) {
	t.Helper()
	first := false
	w.once.Do(func() { first = true; close(w.stop) })
	if !first {
		return
	}
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.seen) > 0 {
		var l []string
		for s := range w.seen {
			l = append(l, s)
		}
		t.Errorf("the host's mount table showed %s during the test: %v", what, l)
	} else {
		t.Logf("host mount table polled %d times: never showed %s", w.polls, what)
	}
}

func prepDevWatch(t *testing.T, d prepDev) *prepWatch {
	return prepWatchHost(t, d.String()+" mounted", func(mi *mountinfo.Info) bool {
		return (uint32(mi.Major) == d.Major && uint32(mi.Minor) == d.Minor) || mi.Source == d.Path ||
			(mi.Root == "/"+d.name() && mi.FSType == "devtmpfs")
	})
}

// --- small things ---

// prepNoPID returns a PID that no process has.
func prepNoPID(t *testing.T) int {
	t.Helper()
	max := 4194304
	if b, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			max = n
		}
	}
	for pid := max - 1; pid > max-1000; pid-- {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, fs.ErrNotExist) {
			return pid
		}
	}
	t.Fatal("no free PID found")
	return 0
}

// prepTimed logs the steps of a test with the time since it started.
type prepTimed struct {
	t     *testing.T
	start time.Time
}

func prepTimer(t *testing.T) *prepTimed { return &prepTimed{t: t, start: time.Now()} }

func (p *prepTimed) step(name string) {
	p.t.Helper()
	p.t.Logf("== %s (at %v)", name, time.Since(p.start).Round(time.Millisecond))
}
