//go:build linux

package nri

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	"google.golang.org/protobuf/proto"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestClaimsNameTheirPod: the plugin hears who a container is (the
// runtime's pod and container name) with each claim, and that is taken
// from the event, not from the annotation, which records none of it.
func TestClaimsNameTheirPod(t *testing.T) {
	kubelet := "/var/lib/kubelet"
	target := podTarget(kubelet, "uid-pod-a", "pv-a")
	vols := &hostileVolumes{byTarget: map[string][]plan.Mount{target: {{Type: "ext4", Source: "/dev/loop7"}}}}
	h := NewHook(vols, &hostileMounter{}, t.TempDir(), kubelet)
	rec, err := json.Marshal([]Claim{{VolumeID: "vol-a", Target: target, Destination: "/data",
		Pod: PodRef{Namespace: "forged", Name: "forged", Container: "forged"}}})
	if err != nil {
		t.Fatal(err)
	}
	if string(rec) != `[{"volumeID":"vol-a","target":"`+target+`","destination":"/data"}]` {
		t.Errorf("the annotation records more than before: %s", rec)
	}
	pod := &nriapi.PodSandbox{Id: "sandbox-a", Uid: "uid-pod-a", Name: "web-0", Namespace: "shop"}
	ctr := &nriapi.Container{Id: "ctr-a", PodSandboxId: pod.Id, Name: "app", Pid: 4242,
		Annotations: map[string]string{Annotation: string(rec)}}
	if err := h.StartContainer(context.Background(), pod, ctr); err != nil {
		t.Fatal(err)
	}
	got := vols.preparedFor(target)
	want := PodRef{Namespace: "shop", Name: "web-0", UID: "uid-pod-a", Container: "app"}
	if len(got) != 1 || got[0].Pod != want || got[0].ContainerID != "ctr-a" || got[0].PID != 4242 {
		t.Fatalf("prepared %+v, want one claim of %+v", got, want)
	}
	wire := podOf(got[0])
	if !proto.Equal(wire, &api.PodRef{Namespace: "shop", Name: "web-0", Uid: "uid-pod-a", Container: "app"}) {
		t.Errorf("on the wire: %v", wire)
	}
	if podOf(Claim{}) != nil {
		t.Error("a claim without a pod sends one")
	}
	// A name the plugin would refuse is not sent: the container must not
	// fail over what is only shown.
	for _, odd := range []PodRef{{Namespace: "shop", Name: "web 0"}, {Name: "a/b"}, {Container: "c\x00"}, {UID: strings.Repeat("u", 254)}} {
		if p := podOf(Claim{Pod: odd}); p != nil {
			t.Errorf("%+v sent as %v", odd, p)
		}
	}
}
