package nri

import (
	"context"
	"encoding/json"
	"slices"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/pkg/plan"
)

func TestOCIMounts(t *testing.T) {
	got, err := ociMounts("/data", []plan.Mount{
		{Type: "ext4", Source: "/dev/loop7", Options: []string{"nosuid", "nodev"}},
		{Type: plan.TypeBind, Source: "/var/lib/mountplan/fuse/v/mnt", Target: "sub", Options: []string{"nosuid", "nodev", "ro"}},
		{Type: plan.TypeBind, Source: "/var/lib/mountplan/x", Target: "rec", Options: []string{"rec", "nosuid"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []*nriapi.Mount{
		{Destination: "/data", Type: "ext4", Source: "/dev/loop7", Options: []string{"nosuid", "nodev", "rprivate"}},
		{Destination: "/data/sub", Type: "bind", Source: "/var/lib/mountplan/fuse/v/mnt", Options: []string{"bind", "nosuid", "nodev", "ro", "rprivate"}},
		{Destination: "/data/rec", Type: "bind", Source: "/var/lib/mountplan/x", Options: []string{"rbind", "nosuid", "rprivate"}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d mounts, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Destination != want[i].Destination || got[i].Type != want[i].Type || got[i].Source != want[i].Source || !slices.Equal(got[i].Options, want[i].Options) {
			t.Errorf("mount %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
	if _, err := ociMounts("/dev/xvda", []plan.Mount{{Type: plan.TypeBind, Source: "/dev/loop7", Options: []string{"nosuid"}}}); err == nil {
		t.Error("a device bind was turned into a mount")
	}
}

// The hook's claims travel in the container's annotation: what
// CreateContainer wrote is what StopContainer releases, for the container
// the event names; a container without it, or with garbage, releases
// nothing.
func TestReleaseFromAnnotation(t *testing.T) {
	claims := []Claim{{VolumeID: "v1", Target: "/k/pods/u/volumes/kubernetes.io~csi/pv/mount", Destination: "/data"},
		{VolumeID: "v2", Major: 7, Minor: 3, Destination: "/dev/xvda"}}
	rec, _ := json.Marshal(claims)
	f := &fakeVolumes{}
	h := NewHook(f, nil, "", "")
	ctr := &nriapi.Container{Id: "c1", Annotations: map[string]string{Annotation: string(rec)}}
	if _, err := h.StopContainer(context.Background(), nil, ctr); err != nil {
		t.Fatal(err)
	}
	h.wait()
	if got := f.releases(); len(got) != 2 || got[0].ContainerID != "c1" || got[0].VolumeID != "v1" || got[1].Destination != "/dev/xvda" {
		t.Errorf("released %+v", got)
	}
	for _, a := range []map[string]string{nil, {Annotation: "not json"}} {
		err := h.RemoveContainer(context.Background(), nil, &nriapi.Container{Id: "c2", Annotations: a})
		h.wait()
		if got := f.releases(); err != nil || len(got) != 2 {
			t.Errorf("annotations %v: released %+v, %v", a, got, err)
		}
	}
}
