//go:build linux

package nri

// The review of 2026-12 found holes in the NRI hook; each test here sends
// what used to get through and asserts it no longer does. Their versions
// against the code the review read failed: that was the demonstration.

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
)

// hostileVolumes is the plugin's NodePrepare service: it knows the volumes
// published in NRI mode (by target, or by device number for block access)
// and records every claim it is asked to prepare.
type hostileVolumes struct {
	mu       sync.Mutex
	byTarget map[string][]plan.Mount
	block    map[[2]uint32][]plan.Mount
	prepared []Claim
}

func (f *hostileVolumes) Prepare(_ context.Context, c Claim) (string, []plan.Mount, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.prepared = append(f.prepared, c)
	if m, ok := f.byTarget[c.Target]; ok && c.Target != "" {
		return "vol:" + c.Target, m, nil
	}
	if m, ok := f.block[[2]uint32{c.Major, c.Minor}]; ok && c.Target == "" {
		return "block-vol", m, nil
	}
	return "", nil, errdefs.ErrNotFound
}

func (f *hostileVolumes) Release(context.Context, Claim) error { return nil }
func (f *hostileVolumes) Sync(context.Context, []string) error { return nil }

// preparedFor lists the claims prepared for target.
func (f *hostileVolumes) preparedFor(target string) []Claim {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []Claim
	for _, c := range f.prepared {
		if c.Target == target {
			out = append(out, c)
		}
	}
	return out
}

// hostileMounter records the plans it is asked to perform.
type hostileMounter struct {
	mu     sync.Mutex
	mounts []plan.Consumer
}

func (m *hostileMounter) Mount(_ context.Context, _ []plan.Mount, c plan.Consumer) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mounts = append(m.mounts, c)
	return nil
}

func (m *hostileMounter) Unmount(context.Context, []plan.Mount, plan.Consumer) error { return nil }

// CheckPlan accepts every plan: the tests that use this mounter are about
// the hook's own checks; TestHostilePlansNeverReachTheRuntime runs the
// mounter's.
func (m *hostileMounter) CheckPlan(context.Context, []plan.Mount) error { return nil }

// podTarget is kubelet's target path of a CSI volume of a pod.
func podTarget(kubelet, podUID, pv string) string {
	return filepath.Join(kubelet, "pods", podUID, "volumes", "kubernetes.io~csi", pv, "mount")
}

// applyAnnotations is what the runtime keeps of a container's annotations
// after an adjustment: removals ("-key") and additions applied.
func applyAnnotations(have map[string]string, adj *nriapi.ContainerAdjustment) map[string]string {
	out := map[string]string{}
	for k, v := range have {
		out[k] = v
	}
	for k, v := range adj.GetAnnotations() {
		if key, removed := nriapi.IsMarkedForRemoval(k); removed {
			delete(out, key)
		} else {
			out[k] = v
		}
	}
	return out
}

// TestReview2StartContainerTrustsAnnotation (review finding 2): the claims
// StartContainer acts on are read from the container's own annotation, and
// the pod UID in a claim's target is compared with the container's pod
// only at Synchronize. A container of pod A whose annotation names pod
// B's volume (an annotation the runtime passes through from the pod, or
// that another NRI plugin sets) is recorded as a consumer of it, and with
// atStart the mounter mounts pod B's volume in pod A's container.
// CreateContainer, which finds no volume of its own, leaves the forged
// annotation in place. Secure: no Prepare and no Mount for pod B's target.
func TestReview2StartContainerTrustsAnnotation(t *testing.T) {
	kubelet := "/var/lib/kubelet"
	targetB := podTarget(kubelet, "uid-pod-b", "pv-b")
	for _, tt := range []struct {
		name    string
		atStart bool
	}{
		{"a claim the mounter performs at start", true},
		{"a claim only recorded at start", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			vols := &hostileVolumes{byTarget: map[string][]plan.Mount{
				targetB: {{Type: "ext4", Source: "/dev/loop7", Options: []string{"nosuid", "nodev", "ro"}}},
			}}
			m := &hostileMounter{}
			h := NewHook(vols, m, t.TempDir(), kubelet)
			forged, err := json.Marshal([]Claim{{VolumeID: "vol-b", Target: targetB, Destination: "/stolen", AtStart: tt.atStart}})
			if err != nil {
				t.Fatal(err)
			}
			podA := &nriapi.PodSandbox{Id: "sandbox-a", Uid: "uid-pod-a", Name: "a", Namespace: "tenant-a"}
			ctr := &nriapi.Container{Id: "ctr-a", PodSandboxId: podA.Id, Name: "app", Pid: uint32(os.Getpid()),
				Annotations: map[string]string{Annotation: string(forged)}}
			ctx := context.Background()
			adj, _, err := h.CreateContainer(ctx, podA, ctr)
			if err != nil {
				t.Fatalf("CreateContainer: %v", err)
			}
			ctr.Annotations = applyAnnotations(ctr.Annotations, adj)
			startErr := h.StartContainer(ctx, podA, ctr)
			if got := vols.preparedFor(targetB); len(got) != 0 || len(m.mounts) != 0 {
				t.Errorf("StartContainer of a container of pod A = %v; the plugin prepared pod B's volume %d times (%+v) and the mounter mounted %+v",
					startErr, len(got), got, m.mounts)
			}
		})
	}
}

// bindGuard binds the live guard at target, as the plugin's NRI-mode
// publish does through the mounter; cleanup unmounts it.
func bindGuard(t *testing.T, stateDir, target string) {
	t.Helper()
	src, err := guard.Source(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := mountns.Build(guard.Bind(src))
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	if err := mountns.Attach(fd, target); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mountns.Unmount(target, true) })
}

// TestReview2CreateContainerOtherPodsTarget (review finding 2): at
// CreateContainer the hook claims every bind of a guard-backed target
// below kubelet's pods directory, without comparing the pod UID in the
// path with the container's pod. A container of pod A that binds pod B's
// target (a hostPath volume naming it) gets pod B's volume in place of the
// guard. Secure: the hook refuses (PermissionDenied) or leaves the bind as
// it is, and pod B's volume is not prepared for it.
func TestReview2CreateContainerOtherPodsTarget(t *testing.T) {
	state, kubelet := hookDirs(t)
	targetA, targetB := podTarget(kubelet, "uid-pod-a", "pv-a"), podTarget(kubelet, "uid-pod-b", "pv-b")
	mkdirs(t, targetA, targetB)
	vols := &hostileVolumes{byTarget: map[string][]plan.Mount{
		targetA: {{Type: "tmpfs", Source: "vol-a", Options: []string{"nosuid", "nodev"}}},
		targetB: {{Type: "tmpfs", Source: "vol-b", Options: []string{"nosuid", "nodev"}}},
	}}
	h := NewHook(vols, &hostileMounter{}, state, kubelet)
	ctx := context.Background()
	startGuard(t, h)
	bindGuard(t, state, targetA)
	bindGuard(t, state, targetB)

	podA := &nriapi.PodSandbox{Id: "sandbox-a", Uid: "uid-pod-a", Name: "a", Namespace: "tenant-a"}
	bind := func(src, dst string) *nriapi.Mount {
		return &nriapi.Mount{Source: src, Destination: dst, Type: "bind", Options: []string{"rbind", "rprivate", "rw"}}
	}
	// The control: pod A's own volume is claimed.
	own := &nriapi.Container{Id: "ctr-own", PodSandboxId: podA.Id, Name: "app", Mounts: []*nriapi.Mount{bind(targetA, "/own")}}
	if adj, _, err := h.CreateContainer(ctx, podA, own); err != nil || len(adj.GetMounts()) != 1 || len(vols.preparedFor(targetA)) != 1 {
		t.Fatalf("CreateContainer of pod A's own volume = %v, %v (prepared %+v), want its mount claimed", adj, err, vols.prepared)
	}
	ctr := &nriapi.Container{Id: "ctr-a", PodSandboxId: podA.Id, Name: "app", Mounts: []*nriapi.Mount{
		bind(targetA, "/own"),
		bind(targetB, "/stolen"),
	}}
	adj, _, err := h.CreateContainer(ctx, podA, ctr)
	var dests []string
	for _, m := range adj.GetMounts() {
		dests = append(dests, m.GetDestination()+"<-"+m.GetSource())
	}
	if got := vols.preparedFor(targetB); len(got) != 0 {
		t.Errorf("CreateContainer of a container of pod A = %v; the plugin prepared pod B's volume for it (%+v) and the container gets mounts %q",
			err, got, dests)
	}
}

// grantsWrite reports whether the runtime, applying adj, lets the
// container write block device major:minor: each device the adjustment
// adds comes with an allow rule of its AccessString (what NRI's
// generate.AdjustDevices does), and a later deny rule of the adjustment's
// resources takes "w" away again.
func grantsWrite(adj *nriapi.ContainerAdjustment, major, minor int64) bool {
	w := false
	for _, d := range adj.GetLinux().GetDevices() {
		if d.GetType() == "b" && d.GetMajor() == major && d.GetMinor() == minor {
			w = strings.Contains(d.AccessString(), "w")
		}
	}
	for _, r := range adj.GetLinux().GetResources().GetDevices() {
		if r.GetType() != "b" && r.GetType() != "a" || !strings.Contains(r.GetAccess(), "w") {
			continue
		}
		if (r.GetMajor() == nil || r.GetMajor().GetValue() == major) && (r.GetMinor() == nil || r.GetMinor().GetValue() == minor) {
			w = r.GetAllow()
		}
	}
	return w
}

// TestReview3BlockVolumeLosesReadOnly (review finding 3): a block volume
// kubelet gives a container read-only (its device cgroup rule is "r") was
// claimed as a writable one, and the device the hook put in the
// container's place was added with the runtime's default access, "rwm".
// Now the claim is read-only, the container keeps kubelet's device, and a
// read-only claim (kubelet's "r", or a plan that binds the device ro)
// comes with a rule that denies writes. A plan whose device is not the
// container's is refused.
func TestReview3BlockVolumeLosesReadOnly(t *testing.T) {
	mountnstest.RequireRoot(t)
	// The plan's device: a node under /dev with a loop device's numbers
	// (only its numbers are read).
	devDir, err := os.MkdirTemp("/dev", "mountplan-test-")
	if err != nil {
		t.Fatal(err)
	}
	node, other := filepath.Join(devDir, "vol"), filepath.Join(devDir, "other")
	t.Cleanup(func() { os.Remove(node); os.Remove(other); os.Remove(devDir) })
	const major, minor = 7, 200
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(major, minor))); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(other, unix.S_IFBLK|0o600, int(unix.Mkdev(major, minor+1))); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name      string
		access    string   // the cgroup access kubelet asked for
		opts      []string // the plan's options
		source    string   // the plan's device
		claimRO   bool     // the claim the plugin is asked for is read-only
		readOnly  bool     // the container may not write the device
		wantError bool
	}{
		{"kubelet gives the device read-only", "r", []string{"nosuid"}, node, true, true, false},
		{"the plan binds the device ro", "rwm", []string{"nosuid", "ro"}, node, false, true, false},
		{"(control) a writable volume", "rwm", []string{"nosuid"}, node, false, false, false},
		{"the plan's device is not the container's", "rwm", []string{"nosuid"}, other, false, false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			vols := &hostileVolumes{block: map[[2]uint32][]plan.Mount{
				{major, minor}: {{Type: plan.TypeBind, Source: tt.source, Options: tt.opts}},
			}}
			h := NewHook(vols, &hostileMounter{}, t.TempDir(), "/var/lib/kubelet")
			ctr := &nriapi.Container{Id: "ctr", PodSandboxId: "sandbox", Name: "app", Linux: &nriapi.LinuxContainer{
				Devices: []*nriapi.LinuxDevice{{Path: "/dev/xvdz-mountplan-test", Type: "b", Major: major, Minor: minor}},
				Resources: &nriapi.LinuxResources{Devices: []*nriapi.LinuxDeviceCgroup{{Allow: true, Type: "b",
					Major: nriapi.Int64(major), Minor: nriapi.Int64(minor), Access: tt.access}}},
			}}
			adj, _, err := h.CreateContainer(context.Background(), &nriapi.PodSandbox{Id: "sandbox", Uid: "uid"}, ctr)
			if tt.wantError {
				if !errors.Is(err, errdefs.ErrFailedPrecondition) {
					t.Fatalf("CreateContainer = %v, want FailedPrecondition", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("CreateContainer: %v", err)
			}
			if n := len(adj.GetLinux().GetDevices()); n != 0 {
				t.Errorf("the adjustment adds %d devices; the container keeps the runtime's", n)
			}
			if ro := len(vols.prepared) == 1 && vols.prepared[0].ReadOnly; ro != tt.claimRO {
				t.Errorf("the claim is %+v, want ReadOnly %v", vols.prepared, tt.claimRO)
			}
			// What the container may do: the runtime's rules, then the
			// adjustment's.
			merged := &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{Resources: &nriapi.LinuxResources{
				Devices: append(ctr.GetLinux().GetResources().GetDevices(), adj.GetLinux().GetResources().GetDevices()...)}}}
			if w := grantsWrite(merged, major, minor); w == tt.readOnly {
				t.Errorf("the container may write the device: %v, want %v", w, !tt.readOnly)
			}
		})
	}
}

// slowVolumes is a plugin that answers Prepare only when its caller gives
// up.
type slowVolumes struct{ hostileVolumes }

func (s *slowVolumes) Prepare(ctx context.Context, _ Claim) (string, []plan.Mount, error) {
	<-ctx.Done()
	return "", nil, ctx.Err()
}

// TestReviewHookTimeout (review finding 6): a CreateContainer slower than
// the runtime's plugin timeout let the container start without the
// adjustment, on the guard. The hook now gives up first, with an error
// that fails the container's creation.
func TestReviewHookTimeout(t *testing.T) {
	state, kubelet := hookDirs(t)
	target := podTarget(kubelet, "uid-pod-a", "pv-a")
	mkdirs(t, target)
	h := NewHook(&slowVolumes{}, &hostileMounter{}, state, kubelet)
	h.Timeout = 100 * time.Millisecond
	ctx := context.Background()
	startGuard(t, h)
	bindGuard(t, state, target)
	pod := &nriapi.PodSandbox{Id: "sandbox-a", Uid: "uid-pod-a", Name: "a", Namespace: "tenant-a"}
	ctr := binding(pod, target)
	adj, _, err := h.CreateContainer(ctx, pod, ctr)
	if !errors.Is(err, context.DeadlineExceeded) || adj != nil {
		t.Fatalf("CreateContainer with a plugin that does not answer = %v, %v; want DeadlineExceeded and no adjustment", adj, err)
	}
}
