package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// busyVolumes answers Aborted (the volume busy with other work) to the
// first busy Prepare calls.
type busyVolumes struct {
	hostileVolumes
	busy int
}

func (b *busyVolumes) Prepare(ctx context.Context, c Claim) (string, []plan.Mount, error) {
	b.mu.Lock()
	if b.busy > 0 {
		b.busy--
		b.prepared = append(b.prepared, c)
		b.mu.Unlock()
		return "", nil, errdefs.ErrAborted
	}
	b.mu.Unlock()
	return b.hostileVolumes.Prepare(ctx, c)
}

// TestSynchronizeRetriesBusyVolumes: at a registration (the mounter
// restarted), the plugin's reconcile of the same restart may hold a
// volume's lock; the claim of a running container is asked for again
// until the plugin takes it, with the container's PID, since nothing
// else would tell the plugin its namespace (TestNRIMounterKilled saw the
// claim left without one).
func TestSynchronizeRetriesBusyVolumes(t *testing.T) {
	state, kubelet := hookDirs(t)
	target := podTarget(kubelet, "uid-pod", "pv")
	mkdirs(t, target)
	vols := &busyVolumes{busy: 3, hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{
		target: {{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}}},
	}}}
	h := NewHook(vols, &hostileMounter{}, state, kubelet)
	ctx := context.Background()
	t.Cleanup(func() { h.stopGuard(ctx) })
	claims, _ := json.Marshal([]Claim{{VolumeID: "vol", Target: target, Destination: "/data"}})
	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}
	ctr := &nriapi.Container{Id: "ctr", PodSandboxId: pod.Id, State: nriapi.ContainerState_CONTAINER_RUNNING, Pid: 4242,
		Annotations: map[string]string{Annotation: string(claims)}}
	if _, err := h.Synchronize(ctx, []*nriapi.PodSandbox{pod}, []*nriapi.Container{ctr}); err != nil {
		t.Fatal(err)
	}
	h.wait()
	got := vols.preparedFor(target)
	if len(got) != 4 || got[3].PID != 4242 || got[3].ContainerID != "ctr" {
		t.Errorf("Synchronize asked the plugin %d times (%+v), want 3 busy answers and then the claim with the container's PID", len(got), got)
	}
}

// gatedVolumes holds every Prepare until gate closes, and records Sync.
type gatedVolumes struct {
	hostileVolumes
	gate   chan struct{}
	synced []string
}

func (g *gatedVolumes) Prepare(ctx context.Context, c Claim) (string, []plan.Mount, error) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		return "", nil, ctx.Err()
	}
	return g.hostileVolumes.Prepare(ctx, c)
}

func (g *gatedVolumes) Sync(_ context.Context, ids []string) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.synced = ids
	return nil
}

// TestSynchronizeAnswersBeforeRelearning: the runtime creates no
// container until Synchronize returns and drops a hook that overruns its
// timeout, so Synchronize answers once the guard runs and the plugin has
// forgotten the containers that are gone, while the plugin has not yet
// answered the re-learning of the running containers' claims, which then
// completes, each claim with its container's PID.
func TestSynchronizeAnswersBeforeRelearning(t *testing.T) {
	state, kubelet := hookDirs(t)
	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}
	vols := &gatedVolumes{gate: make(chan struct{}), hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{}}}
	var ctrs []*nriapi.Container
	for i := range 20 {
		target := podTarget(kubelet, "uid-pod", fmt.Sprintf("pv-%d", i))
		mkdirs(t, target)
		vols.byTarget[target] = []plan.Mount{{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}}}
		claims, _ := json.Marshal([]Claim{{VolumeID: fmt.Sprint("vol-", i), Target: target, Destination: "/data"}})
		ctrs = append(ctrs, &nriapi.Container{Id: fmt.Sprint("ctr-", i), PodSandboxId: pod.Id, State: nriapi.ContainerState_CONTAINER_RUNNING,
			Pid: uint32(1000 + i), Annotations: map[string]string{Annotation: string(claims)}})
	}
	// A container created and not started: its claims are told at its
	// StartContainer, never re-learned without a namespace.
	created := podTarget(kubelet, "uid-pod", "pv-created")
	mkdirs(t, created)
	vols.byTarget[created] = []plan.Mount{{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}}}
	claims, _ := json.Marshal([]Claim{{VolumeID: "vol-created", Target: created, Destination: "/data"}})
	allCtrs := append(ctrs, &nriapi.Container{Id: "ctr-created", PodSandboxId: pod.Id, State: nriapi.ContainerState_CONTAINER_CREATED,
		Annotations: map[string]string{Annotation: string(claims)}})
	h := NewHook(vols, &hostileMounter{}, state, kubelet)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second) // the runtime's deadline
	defer cancel()
	t.Cleanup(func() { h.stopGuard(context.Background()) })
	if _, err := h.Synchronize(ctx, []*nriapi.PodSandbox{pod}, allCtrs); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatal("Synchronize waited for the re-learning past the runtime's deadline")
	}
	vols.mu.Lock()
	synced, prepared := len(vols.synced), len(vols.prepared)
	vols.mu.Unlock()
	if synced != len(allCtrs) || prepared != 0 {
		t.Fatalf("at the answer: Sync of %d containers, %d claims re-learned; want %d and 0", synced, prepared, len(allCtrs))
	}
	<-ctx.Done() // the event's context ends: the re-learning goes on
	close(vols.gate)
	h.wait()
	if got := vols.preparedFor(created); len(got) != 0 {
		t.Errorf("the claim of a container not started was re-learned: %+v", got)
	}
	for i, ctr := range ctrs {
		got := vols.preparedFor(podTarget(kubelet, "uid-pod", fmt.Sprintf("pv-%d", i)))
		if len(got) != 1 || got[0].PID != int(ctr.Pid) || got[0].ContainerID != ctr.Id {
			t.Errorf("container %s: re-learned %+v, want its claim once with PID %d", ctr.Id, got, ctr.Pid)
		}
	}
}

// slowSync answers Sync only when its caller gives up.
type slowSync struct{ hostileVolumes }

func (s *slowSync) Sync(ctx context.Context, _ []string) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestSynchronizeFailsWhenSyncOverruns: a Sync the plugin has not
// finished when the hook's bound runs out may still be releasing claims
// with the runtime's old list, so Synchronize fails the registration
// rather than let the runtime create containers meanwhile.
func TestSynchronizeFailsWhenSyncOverruns(t *testing.T) {
	state, kubelet := hookDirs(t)
	h := NewHook(&slowSync{}, &hostileMounter{}, state, kubelet)
	h.Timeout = 100 * time.Millisecond
	t.Cleanup(func() { h.stopGuard(context.Background()) })
	if _, err := h.Synchronize(context.Background(), nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Synchronize with a Sync that overran = %v, want DeadlineExceeded", err)
	}
}

// releasingVolumes records releases as well as prepares.
type releasingVolumes struct {
	hostileVolumes
	released []Claim
}

func (r *releasingVolumes) Release(_ context.Context, c Claim) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.released = append(r.released, c)
	return nil
}

// TestFailedCreationReleasesWhatItPrepared: a container's creation that
// fails after the plugin prepared one of its volumes (a plan the runtime
// cannot perform at that destination) releases that claim: left behind,
// it would keep the volume from being unstaged.
func TestFailedCreationReleasesWhatItPrepared(t *testing.T) {
	state, kubelet := hookDirs(t)
	target := podTarget(kubelet, "uid-pod", "pv")
	mkdirs(t, target)
	// A device bind is no plan for a mount destination: ociMounts refuses.
	vols := &releasingVolumes{hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{
		target: {{Type: plan.TypeBind, Source: "/dev/loop7", Options: []string{"nosuid"}}},
	}}}
	h := NewHook(vols, &hostileMounter{}, state, kubelet)
	ctx := context.Background()
	startGuard(t, h)
	bindGuard(t, state, target)
	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}
	ctr := binding(pod, target)
	if _, _, err := h.CreateContainer(ctx, pod, ctr); err == nil {
		t.Fatal("CreateContainer with a plan the runtime cannot perform succeeded")
	}
	if got := vols.preparedFor(target); len(got) != 1 {
		t.Fatalf("prepared %+v, want the claim once", got)
	}
	h.wait()
	vols.mu.Lock()
	defer vols.mu.Unlock()
	if len(vols.released) != 1 || vols.released[0].ContainerID != "ctr" || vols.released[0].VolumeID != "vol:"+target {
		t.Errorf("released %+v, want the prepared claim of ctr", vols.released)
	}
}

// hookDirs makes a scratch state dir (where the guard lives) and names a
// kubelet dir beside it, for tests that start the guard (root, FUSE).
func hookDirs(t *testing.T) (state, kubelet string) {
	t.Helper()
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	state, kubelet = filepath.Join(dir, "state"), filepath.Join(dir, "kubelet")
	mkdirs(t, state)
	return state, kubelet
}

func mkdirs(t *testing.T, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
}

// startGuard starts h's guard, as a registration does (Synchronize), and
// stops it when the test ends.
func startGuard(t *testing.T, h *Hook) {
	t.Helper()
	if _, err := h.Synchronize(context.Background(), nil, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.stopGuard(context.Background()) })
}

// binding is a container "ctr" of pod that binds target at /data, as the
// runtime hands kubelet's bind of a volume's publish over.
func binding(pod *nriapi.PodSandbox, target string) *nriapi.Container {
	return &nriapi.Container{Id: "ctr", PodSandboxId: pod.Id, Name: "app",
		Mounts: []*nriapi.Mount{{Source: target, Destination: "/data", Type: "bind", Options: []string{"rbind", "rw"}}}}
}

// TestBusyVolumeDoesNotFailContainers: the plugin's reconcile holds a
// volume's lock for a moment (its startup pass, retried each second while
// the mounter is not up yet), and a Prepare meanwhile is Aborted. A
// container created or started in that moment is not failed for it: the
// hook asks again within its deadline. Seen in make test: TestNRISubPath
// failed its "deep" container's creation with "nri-subpath is busy with
// reconcile", and under CRI-O the start of a subPath container.
func TestBusyVolumeDoesNotFailContainers(t *testing.T) {
	state, kubelet := hookDirs(t)
	target := podTarget(kubelet, "uid-pod", "pv")
	mkdirs(t, target)
	vols := &busyVolumes{busy: 3, hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{
		target: {{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}}},
	}}}
	mnt := &hostileMounter{}
	h := NewHook(vols, mnt, state, kubelet)
	ctx := context.Background()
	startGuard(t, h)
	bindGuard(t, state, target)
	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}
	adj, _, err := h.CreateContainer(ctx, pod, binding(pod, target))
	if err != nil || len(adj.GetMounts()) != 1 {
		t.Fatalf("CreateContainer of a volume busy 3 times: %v, %v; want the volume's mount", describe(adj), err)
	}

	// The start of a container whose plan the mounter performs then (a
	// subPath).
	vols.mu.Lock()
	vols.busy = 3
	vols.mu.Unlock()
	proc := exec.Command("sleep", "60")
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proc.Process.Kill(); _ = proc.Wait() })
	rec, _ := json.Marshal([]Claim{{VolumeID: "vol", Target: target, Destination: "/cfg", SubPath: "app", AtStart: true}})
	ctr := &nriapi.Container{Id: "ctr-sub", PodSandboxId: pod.Id, Name: "sub", Pid: uint32(proc.Process.Pid),
		Annotations: map[string]string{Annotation: string(rec)}}
	if err := h.StartContainer(ctx, pod, ctr); err != nil {
		t.Fatalf("StartContainer of a subPath of a volume busy 3 times: %v", err)
	}
	mnt.mu.Lock()
	defer mnt.mu.Unlock()
	if len(mnt.mounts) != 1 || mnt.mounts[0].SubPath != "app" || mnt.mounts[0].PID != proc.Process.Pid {
		t.Errorf("the mounter was asked %+v, want the subPath mounted once into pid %d", mnt.mounts, proc.Process.Pid)
	}
}
