package nri

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

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
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	state, kubelet := filepath.Join(dir, "state"), filepath.Join(dir, "kubelet")
	target := podTarget(kubelet, "uid-pod", "pv")
	for _, d := range []string{state, target} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
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
	got := vols.preparedFor(target)
	if len(got) != 4 || got[3].PID != 4242 || got[3].ContainerID != "ctr" {
		t.Errorf("Synchronize asked the plugin %d times (%+v), want 3 busy answers and then the claim with the container's PID", len(got), got)
	}
}
