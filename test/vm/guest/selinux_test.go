//go:build vmguest

package guest

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/loop"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The SELinux boot (issue 36): test/vm boots the guest a last time with
// security=selinux selinux=1 enforcing=0 and puts at /selinux/policy the
// tiny MLS policy it compiled (test/vm/selinux_test.go); these tests load
// it and show that a context= mount option labels what a pod sees. They
// run only in that boot (the first boot skips ^TestSELinux).

// podLabel is a label as kubelet's SELinuxMount sends it: a pod's MCS
// categories, a comma between them.
const podLabel = "system_u:object_r:container_file_t:s0:c1,c2"

// policyFile is where test/vm puts the compiled policy.
const policyFile = "/selinux/policy"

// loadPolicy mounts selinuxfs and loads the policy once per boot, as
// load_policy(8) would (a write of the binary policy to /sys/fs/selinux/load).
func loadPolicy(t *testing.T) {
	t.Helper()
	requireGuest(t)
	if !mountns.SELinuxEnabled() {
		b, _ := os.ReadFile("/proc/cmdline")
		t.Fatalf("SELinux is not enabled in the guest (no selinuxfs in /proc/filesystems); kernel command line: %s", b)
	}
	if _, err := os.Stat("/sys/fs/selinux/enforce"); err != nil {
		if err := unix.Mount("selinuxfs", "/sys/fs/selinux", "selinuxfs", 0, ""); err != nil {
			t.Fatalf("mount selinuxfs: %v", err)
		}
	}
	if b, _ := os.ReadFile("/sys/fs/selinux/policyvers"); len(b) > 0 {
		t.Logf("the kernel's policy version: %s", bytes.TrimSpace(b))
	}
	if loaded, _ := os.ReadFile("/sys/fs/selinux/mls"); len(loaded) == 0 || string(bytes.TrimSpace(loaded)) != "1" {
		pol, err := os.ReadFile(policyFile)
		if err != nil {
			t.Fatalf("the policy test/vm compiles: %v", err)
		}
		// One write of the whole policy, at offset 0, and no O_TRUNC:
		// selinuxfs takes nothing else.
		load, err := os.OpenFile("/sys/fs/selinux/load", os.O_WRONLY, 0)
		if err != nil {
			t.Fatalf("open /sys/fs/selinux/load: %v", err)
		}
		n, err := load.Write(pol)
		load.Close()
		if err != nil || n != len(pol) {
			t.Fatalf("load the policy (%d bytes, %d written) into /sys/fs/selinux/load: %v", len(pol), n, err)
		}
	}
	enforce, _ := os.ReadFile("/sys/fs/selinux/enforce")
	mls, _ := os.ReadFile("/sys/fs/selinux/mls")
	t.Logf("policy loaded: enforce=%s mls=%s", bytes.TrimSpace(enforce), bytes.TrimSpace(mls))
}

func wantLabel(t *testing.T, what, p string) {
	t.Helper()
	if got := mountnstest.SELinuxLabel(t, p); got != podLabel {
		t.Errorf("%s %s is labelled %q, want %q", what, p, got, podLabel)
	} else {
		t.Logf("MOUNTPLAN-SELINUX %s %s: %s", what, p, got)
	}
}

func labelledCap() *csi.VolumeCapability {
	c := mountCap()
	c.GetMount().MountFlags = []string{plan.ContextOption(podLabel)}
	return c
}

// TestSELinuxLoopVolume: a loop volume staged and published with kubelet's
// context= flag: the target's root and a file written there carry the
// pod's label; a publish asking for another label is refused; an
// NRI-style prepare into a mount namespace of its own gets the label too.
func TestSELinuxLoopVolume(t *testing.T) {
	loadPolicy(t)
	cfg := &config.Config{}
	d, stateDir := newDriver(t, cfg, nil)
	ctx := context.Background()
	id := "labelled"
	if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{labelledCap()}, Parameters: map[string]string{"type": "loop"}}); err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	staging := filepath.Join(stateDir, "staging", id)
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: labelledCap()}); err != nil {
		t.Fatalf("NodeStageVolume with context=: %v", err)
	}
	target := filepath.Join(stateDir, "pods", id, "mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: labelledCap()}); err != nil {
		t.Fatalf("NodePublishVolume with context=: %v", err)
	}
	file := filepath.Join(target, "written.txt")
	if err := os.WriteFile(file, []byte("labelled\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantLabel(t, "published target", target)
	wantLabel(t, "file written there", file)

	other := mountCap()
	other.GetMount().MountFlags = []string{plan.ContextOption("system_u:object_r:container_file_t:s0:c3,c4")}
	_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		TargetPath: filepath.Join(stateDir, "pods", id+"-other", "mount"), VolumeCapability: other})
	wantCode(t, "a publish with another label", err, codes.FailedPrecondition)

	prepareIntoNamespace(t, d, ctx, id, staging)

	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

type preparer interface {
	NodePrepareVolume(context.Context, *api.NodePrepareVolumeRequest) (*api.NodePrepareVolumeResponse, error)
	NodeUnprepareVolume(context.Context, *api.NodeUnprepareVolumeRequest) (*api.NodeUnprepareVolumeResponse, error)
}

// prepareIntoNamespace: NodePrepareVolume for a process in a mount
// namespace of its own, its plan performed there by the mounter, as
// mountplan-sidecar prepare does; the mount point, seen from inside,
// carries the label.
func prepareIntoNamespace(t *testing.T, p preparer, ctx context.Context, id, staging string) {
	t.Helper()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatalf("unshare: %v", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	for i := 0; i < 100; i++ {
		if b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm"); strings.TrimSpace(string(b)) == "sleep" {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The mounter enters only namespaces it can attribute: named here as
	// the NRI hook names a container's.
	stateDir := filepath.Dir(filepath.Dir(staging))
	node, _ := nodes.Load(stateDir)
	if _, err := node.(*mounter.Local).Attribute(ctx, pid, mounter.ByAdmin, ""); err != nil {
		t.Fatalf("Attribute the consumer's namespace: %v", err)
	}
	mp := filepath.Join(t.TempDir(), "prepared")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	resp, err := p.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: labelledCap(),
		Consumer: &api.Consumer{Pid: int64(pid), MountPoint: mp}})
	if err != nil {
		t.Fatalf("NodePrepareVolume with context=: %v", err)
	}
	mounts := plan.FromProto(resp.GetMounts())
	t.Logf("the prepared plan: %v", mounts)
	cons, err := plan.ConsumerFromProto(resp.GetConsumer())
	if err != nil {
		t.Fatal(err)
	}
	m := mounterForID(t, staging)
	if err := m.Mount(ctx, mounts, cons); err != nil {
		t.Fatalf("the mounter performing the prepared plan: %v", err)
	}
	wantLabel(t, "prepared mount point in the consumer's namespace", filepath.Join("/proc", strconv.Itoa(pid), "root", mp))
	if err := m.Unmount(ctx, mounts, cons); err != nil {
		t.Fatalf("unmount the prepared plan: %v", err)
	}
	if _, err := p.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: id, Consumer: resp.GetConsumer()}); err != nil {
		t.Fatalf("NodeUnprepareVolume: %v", err)
	}
}

// mounterForID is the mounter of the driver whose state dir holds staging.
func mounterForID(t *testing.T, staging string) interface {
	Mount(context.Context, []plan.Mount, plan.Consumer) error
	Unmount(context.Context, []plan.Mount, plan.Consumer) error
} {
	t.Helper()
	return mounterFor(t, nil, filepath.Dir(filepath.Dir(staging)))
}

// TestSELinuxChain: a static loop volume of a squashfs image with
// overlay: "true" (a chain), staged and published with context=: the
// plan binds the overlay, which the stage labelled, so the target, a file
// of the image and a file written through the overlay carry the label.
func TestSELinuxChain(t *testing.T) {
	loadPolicy(t)
	images, content := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("from the image\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(images, "base.sqfs")
	if out, err := exec.Command("mksquashfs", content, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
		t.Fatalf("mksquashfs: %v: %s", err, out)
	}
	cfg := &config.Config{ImageRoots: []string{images}}
	stateDir := t.TempDir()
	d, _ := newDriverAt(t, cfg, func(m *service.Client) map[string]source.Source {
		ls := loop.New(stateDir, m)
		ls.ImageRoots = cfg.ImageRoots
		return map[string]source.Source{loop.Type: ls}
	}, stateDir)
	ctx := context.Background()
	id := "labelled-chain"
	vctx := map[string]string{"type": loop.Type, loop.CtxImage: img, loop.ParamOverlay: "true"}
	staging := filepath.Join(stateDir, "staging", id)
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: labelledCap(),
		VolumeContext: vctx}); err != nil {
		t.Fatalf("NodeStageVolume of a chain with context=: %v", err)
	}
	target := filepath.Join(stateDir, "pods", id, "mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: labelledCap(), VolumeContext: vctx}); err != nil {
		t.Fatalf("NodePublishVolume of a chain with context=: %v", err)
	}
	written := filepath.Join(target, "written.txt")
	if err := os.WriteFile(written, []byte("through the overlay\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantLabel(t, "chain's published target", target)
	wantLabel(t, "chain's file from the image", filepath.Join(target, "hello.txt"))
	wantLabel(t, "chain's file written through the overlay", written)
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

// TestSELinuxFuseFdMode runs the mounter's own test of a squashfuse
// volume in fd mode with context= (the mounter's test binary, which
// test/vm puts at /mounter.test): the FUSE mount the mounter makes
// carries the label. Told that SELinux is on, it may not pass otherwise.
func TestSELinuxFuseFdMode(t *testing.T) {
	loadPolicy(t)
	cmd := exec.Command("/mounter.test", "-test.run", "^TestFdModeContextLabel$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "MOUNTPLAN_WANT_SELINUX=1")
	out, err := cmd.CombinedOutput()
	t.Logf("/mounter.test -test.run ^TestFdModeContextLabel$:\n%s", out)
	if err != nil {
		t.Fatalf("the mounter's test: %v", err)
	}
	if !bytes.Contains(out, []byte("--- PASS: TestFdModeContextLabel")) || !bytes.Contains(out, []byte("labelled "+podLabel)) {
		t.Fatal("the mounter's test did not show the FUSE mount labelled")
	}
}
