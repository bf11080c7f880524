//go:build linux

package nri

import (
	"context"
	"encoding/json"
	"path/filepath"
	"slices"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestUserNSContainerGetsItsPlanAtStart (issue 36): a container with a
// user namespace of its own gets no mount of the plan from the runtime,
// which cannot idmap a filesystem mount (runc refuses "idmap" on anything
// but a bind, and an unprivileged root cannot mount ext4 at all); the
// runtime mounts an empty read-only tmpfs in the guard's place (runc,
// unprivileged by then, cannot reach the guard), and the claim is recorded
// for the mounter at the container's start, which idmaps what it mounts.
// The same container without a user namespace gets the plan from the
// runtime, as before.
func TestUserNSContainerGetsItsPlanAtStart(t *testing.T) {
	state, kubelet := hookDirs(t)
	ctx := context.Background()
	node, err := mounter.NewNode(ctx, mounter.Options{StateDir: state, KubeletDir: kubelet, RecordsDir: filepath.Join(filepath.Dir(state), "records")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Close() })
	env := &planEnv{scratch: filepath.Dir(state), state: state, node: node}
	mounts := []plan.Mount{{Type: "ext4", Source: env.mounterLoop(t), Options: secure}}
	target := podTarget(kubelet, "uid-pod", "pv")
	mkdirs(t, target)
	vols := &releasingVolumes{hostileVolumes: hostileVolumes{byTarget: map[string][]plan.Mount{target: mounts}}}
	h := NewHook(vols, node, state, kubelet)
	startGuard(t, h)
	bindGuard(t, state, target)
	pod := &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"}

	ctr := binding(pod, target)
	ctr.Linux = &nriapi.LinuxContainer{Namespaces: []*nriapi.LinuxNamespace{{Type: "mount"}, {Type: "user"}}}
	adj, _, err := h.CreateContainer(ctx, pod, ctr)
	h.wait()
	if err != nil {
		t.Fatal(err)
	}
	got := adj.GetMounts()
	if len(got) != 1 || got[0].GetType() != "tmpfs" || got[0].GetDestination() != "/data" || !slices.Contains(got[0].GetOptions(), "ro") {
		t.Fatalf("mounts of a user-namespaced container: %s, want a read-only tmpfs at /data alone", describe(adj))
	}
	var claims []Claim
	if err := json.Unmarshal([]byte(adj.GetAnnotations()[Annotation]), &claims); err != nil {
		t.Fatal(err)
	}
	if len(claims) != 1 || !claims[0].AtStart {
		t.Fatalf("claims %+v, want one performed at the container's start", claims)
	}

	ctr = binding(pod, target)
	ctr.Id = "ctr-host-users"
	ctr.Linux = &nriapi.LinuxContainer{Namespaces: []*nriapi.LinuxNamespace{{Type: "mount"}}}
	adj, _, err = h.CreateContainer(ctx, pod, ctr)
	h.wait()
	wantRuntimeMount(t, adj, err, mounts[0])
}
