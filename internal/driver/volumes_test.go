package driver

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/volview"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestVolumesFromRecords: the listing says what the records say: the
// loop source's image and device, the stage, a kubelet publish, an NRI
// publish and a container's claim with its namespace and read-only plan.
func TestVolumesFromRecords(t *testing.T) {
	d, _ := newTestDriver(t)
	state, err := json.Marshal(loop.State{Device: "/dev/loop7"})
	if err != nil {
		t.Fatal(err)
	}
	v := &model.Volume{ID: "pvc-1", Kind: model.KindProvisioned, Type: loop.Type, Image: "/img/pvc-1.img",
		Stage:     &model.Stage{Phase: model.PhaseStaging, StagingPath: "/k/plugins/s", Source: state},
		Publishes: []model.Publish{{TargetPath: "/k/pods/a/mount", ReadOnly: true}, {TargetPath: "/k/pods/b/mount", NRI: true}},
		Consumers: []model.Claim{{Consumer: plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 9}, ContainerID: "c1"},
			Mounts: []plan.Mount{{Type: "bind", Source: "/x", Target: "/data", Options: []string{"bind", "ro"}}}}}}
	if err := d.records.Put(v, journal.Durable); err != nil {
		t.Fatal(err)
	}
	if err := d.records.Put(&model.Volume{ID: "idle", Kind: model.KindProvisioned, Type: loop.Type, Image: "/img/idle.img"}, journal.Durable); err != nil {
		t.Fatal(err)
	}
	r := d.Volumes(context.Background())
	if r.Node != "node-a" || len(r.Volumes) != 2 || len(r.Errors) != 0 {
		t.Fatalf("report %+v", r)
	}
	idle, got := r.Volumes[0], r.Volumes[1]
	if idle.ID != "idle" || idle.Stage != "unstaged" || idle.Health.Status != "-" || idle.Source != "image /img/idle.img" || len(idle.Consumers) != 0 {
		t.Errorf("idle volume: %+v", idle)
	}
	if got.Source != "image /img/pvc-1.img" || got.Device != "/dev/loop7" || got.Stage != "staging" || got.StagingPath != "/k/plugins/s" ||
		got.Health.Status != "-" {
		t.Errorf("volume: %+v", got)
	}
	want := []volview.Consumer{
		{Kind: volview.KindPublish, Path: "/k/pods/a/mount", ReadOnly: true},
		{Kind: volview.KindNRIPublish, Path: "/k/pods/b/mount"},
		{Kind: volview.KindContainer, Path: "/data", ReadOnly: true, PID: 42, MountNS: 9, ContainerID: "c1"},
	}
	if len(got.Consumers) != len(want) {
		t.Fatalf("consumers %+v, want %+v", got.Consumers, want)
	}
	for i := range want {
		if got.Consumers[i] != want[i] {
			t.Errorf("consumer %d: %+v, want %+v", i, got.Consumers[i], want[i])
		}
	}
}
