//go:build linux

package nri

// Finding F2 of issue 33: the hook handed the plugin's plans to the
// runtime unchecked, and runc mounts as root whatever a plan says. Each
// hostile row here is a plan a compromised plugin answers; the hook must
// refuse it, with nothing of it in an adjustment, no device of it opened,
// the claim released and nothing mounted. Against b705b24 every hostile
// row failed: that was the demonstration.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// planEnv is one row's node: a real mounter (its records, its state
// dir) whose hook the plugin answers.
type planEnv struct {
	scratch, state string
	node           *mounter.Local
}

// mounterLoop attaches an image below the state dir through the
// mounter, as a staged volume's device is; cleanup detaches it.
func (e *planEnv) mounterLoop(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(e.state, "images")
	mkdirs(t, dir)
	img := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 8<<20); err != nil {
		t.Fatal(err)
	}
	loop, err := e.node.AttachLoop(context.Background(), mounter.LoopRequest{Image: img})
	if err != nil {
		t.Fatalf("the mounter's AttachLoop: %v", err)
	}
	t.Cleanup(func() {
		if err := e.node.DetachLoop(context.Background(), loop.Identity); err != nil {
			t.Errorf("DetachLoop: %v", err)
		}
	})
	return loop.Path
}

// stateDirectory makes a plain directory of the state dir (a bind source
// the mounter accepts: it carries no mount).
func (e *planEnv) stateDirectory(t *testing.T, name string) string {
	t.Helper()
	d := filepath.Join(e.state, name)
	mkdirs(t, d)
	return d
}

// outside makes a host directory outside the state dir.
func (e *planEnv) outside(t *testing.T) string {
	t.Helper()
	d := filepath.Join(e.scratch, "outside")
	mkdirs(t, d)
	if err := os.WriteFile(filepath.Join(d, "secret"), []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	return d
}

// charNode makes a character device node under /dev with /dev/null's
// numbers: a device like /dev/watchdog, which its first open arms.
func charNode(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev", "mountplan-test-")
	if err != nil {
		t.Fatal(err)
	}
	node := filepath.Join(dir, "watchdog")
	t.Cleanup(func() { os.Remove(node); os.Remove(dir) })
	if err := unix.Mknod(node, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	return node
}

var secure = []string{"nosuid", "nodev"}

type planRow struct {
	name string
	plan func(t *testing.T, e *planEnv) (mounts []plan.Mount, watch string)
	// want is the refusal; nil: the plan is the mounter's own and reaches
	// the runtime as its mount at /data.
	want error
}

var planRows = []planRow{
	{"(control) ext4 on a loop device the mounter attached", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: "ext4", Source: e.mounterLoop(t), Options: secure}}, ""
	}, nil},
	{"(control) a bind of a directory of the state dir", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: plan.TypeBind, Source: e.stateDirectory(t, "vol"), Options: secure}}, ""
	}, nil},
	{"a rec bind of the host's /", func(*testing.T, *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: plan.TypeBind, Source: "/", Options: []string{"rec", "nosuid", "nodev"}}}, ""
	}, errdefs.ErrInvalidArgument},
	{"a rec bind of a directory of the state dir", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: plan.TypeBind, Source: e.stateDirectory(t, "vol"), Options: []string{"rec", "nosuid", "nodev"}}}, ""
	}, errdefs.ErrInvalidArgument},
	{"ext4 on a block device the mounter did not set up", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: "ext4", Source: mountnstest.LoopDevice(t, e.scratch, "", 8), Options: secure}}, ""
	}, errdefs.ErrPermissionDenied},
	{"a target of ../../bin", func(*testing.T, *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: "tmpfs", Source: "vol", Target: "../../bin", Options: secure}}, ""
	}, errdefs.ErrInvalidArgument},
	{"a bind of a host directory outside the state dir", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: plan.TypeBind, Source: e.outside(t), Options: secure}}, ""
	}, errdefs.ErrInvalidArgument},
	{"a bind of a state-dir directory a host directory is mounted on", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		planted := e.stateDirectory(t, "planted")
		if err := unix.Mount(e.outside(t), planted, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(planted, unix.MNT_DETACH) })
		return []plan.Mount{{Type: plan.TypeBind, Source: planted, Options: secure}}, ""
	}, errdefs.ErrPermissionDenied},
	{"a ro filesystem of a character device (a watchdog)", func(t *testing.T, _ *planEnv) ([]plan.Mount, string) {
		node := charNode(t)
		return []plan.Mount{{Type: "ext4", Source: node, Options: []string{"nosuid", "nodev", "ro"}}}, node
	}, errdefs.ErrPermissionDenied},
	{"the mounter's own loop device without nosuid,nodev", func(t *testing.T, e *planEnv) ([]plan.Mount, string) {
		return []plan.Mount{{Type: "ext4", Source: e.mounterLoop(t)}}, ""
	}, errdefs.ErrInvalidArgument},
}

// TestHostilePlansNeverReachTheRuntime (issue 33, F2): every plan the
// hook turns into the container's OCI mounts passes the mounter's checks
// of a socket mount first (policy, targets, devices and bind sources the
// mounter set up, nosuid/nodev, no recursive bind) before any adjustment
// and before any device of it is opened.
func TestHostilePlansNeverReachTheRuntime(t *testing.T) {
	for _, row := range planRows {
		t.Run(row.name, func(t *testing.T) { testRuntimePlan(t, row) })
	}
}

func testRuntimePlan(t *testing.T, row planRow) {
	state, kubelet := hookDirs(t)
	scratch := filepath.Dir(state)
	ctx := context.Background()
	node, err := mounter.NewNode(ctx, mounter.Options{StateDir: state, KubeletDir: kubelet, RecordsDir: filepath.Join(scratch, "records")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Close() })
	env := &planEnv{scratch: scratch, state: state, node: node}
	mounts, watch := row.plan(t, env)
	target := podTarget(kubelet, "uid-pod", "pv")
	mkdirs(t, target)
	vols := &releasingVolumes{hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{target: mounts}}}
	h := NewHook(vols, node, state, kubelet)
	startGuard(t, h)
	bindGuard(t, state, target)
	opened := watchOpens(t, watch)
	before := len(mountnstest.MountsUnder(t, 0, scratch))

	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}
	adj, _, err := h.CreateContainer(ctx, pod, binding(pod, target))
	h.wait()
	if after := len(mountnstest.MountsUnder(t, 0, scratch)); after != before {
		t.Errorf("CreateContainer left %d mounts under the test's dir, %d before", after, before)
	}
	if opened() {
		t.Errorf("the hook opened %s, which the plan names as a device", watch)
	}
	if row.want == nil {
		wantRuntimeMount(t, adj, err, mounts[0])
		return
	}
	if !errors.Is(err, row.want) || adj != nil {
		t.Fatalf("CreateContainer = %v, %v; want no adjustment and %v", describe(adj), err, row.want)
	}
	t.Logf("refused: %v", err)
	vols.mu.Lock()
	defer vols.mu.Unlock()
	if len(vols.released) != 1 || vols.released[0].VolumeID != "vol:"+target || vols.released[0].ContainerID != "ctr" {
		t.Errorf("released %+v, want the refused claim of ctr", vols.released)
	}
}

// wantRuntimeMount asserts the adjustment replaces the container's bind
// with m at /data.
func wantRuntimeMount(t *testing.T, adj *nriapi.ContainerAdjustment, err error, m plan.Mount) {
	t.Helper()
	if err != nil {
		t.Fatalf("CreateContainer of the mounter's own plan: %v", err)
	}
	got := adj.GetMounts()
	if len(got) != 1 || got[0].GetDestination() != "/data" || got[0].GetSource() != m.Source ||
		got[0].GetType() != m.Type || !slices.Contains(got[0].GetOptions(), "nosuid") {
		t.Errorf("the adjustment mounts %v, want %s at /data", describe(adj), m)
	}
}

// describe lists what an adjustment would have the runtime mount.
func describe(adj *nriapi.ContainerAdjustment) []string {
	var out []string
	for _, m := range adj.GetMounts() {
		out = append(out, m.GetType()+" "+m.GetSource()+" at "+m.GetDestination())
	}
	return out
}

// watchOpens reports, when called, whether node was opened since: an
// inotify IN_OPEN watch (a stat raises none). No node: never.
func watchOpens(t *testing.T, node string) func() bool {
	t.Helper()
	if node == "" {
		return func() bool { return false }
	}
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.InotifyAddWatch(fd, node, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	return func() bool {
		buf := make([]byte, 4096)
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EAGAIN) {
			return false
		}
		if err != nil {
			t.Fatalf("read inotify: %v", err)
		}
		return n > 0
	}
}
