package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// needsStageSource is a fakeSource whose Adopt cannot recover its volumes
// (a FUSE daemon whose secrets a reboot took) until they are staged again.
type needsStageSource struct {
	fakeSource
	stages []map[string]string // the secrets of each Stage
}

func (f *needsStageSource) Adopt(_ context.Context, v source.Volume) (json.RawMessage, error) {
	f.adopted = append(f.adopted, v.ID)
	return nil, fmt.Errorf("volume %s: its daemon and secrets are gone: %w", v.ID, source.ErrNeedsStage)
}

func (f *needsStageSource) Stage(_ context.Context, _ source.Volume, req source.StageRequest) (json.RawMessage, error) {
	f.stages = append(f.stages, maps.Clone(req.Secrets))
	return json.RawMessage(`{"generation":2}`), nil
}

// After a reboot kubelet stages again what it had staged: a volume whose
// source cannot recover it from the record is undone and staged anew with
// the request (its secrets), keeping its publishes for kubelet to redo.
func TestStageAgainWhatTheSourceCannotAdopt(t *testing.T) {
	d, _ := newTestDriver(t)
	src := &needsStageSource{}
	d.sources["fake"] = src
	staging := d.kubelet.root + "/plugins/kubernetes.io/csi/mountplan.csi.io/x/globalmount"
	target := d.kubelet.root + "/pods/p/volumes/kubernetes.io~csi/v/mount"
	v := &model.Volume{ID: "v", Kind: model.KindStatic, Type: "fake",
		Stage:     &model.Stage{Phase: model.PhaseStaged, StagingPath: staging, Source: json.RawMessage(`{"generation":1}`)},
		Publishes: []model.Publish{{TargetPath: target}}}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	_, err := d.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging,
		VolumeCapability: rwo, Secrets: map[string]string{"conf": "s3cret"}})
	if err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if len(src.adopted) != 1 || len(src.unstaged) != 1 || len(src.stages) != 1 || src.stages[0]["conf"] != "s3cret" {
		t.Errorf("adopted %v, unstaged %v, staged with %d secrets sets: want one of each, with the request's secrets",
			src.adopted, src.unstaged, len(src.stages))
	}
	got, err := d.records.Get("v")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Staged() || string(got.Stage.Source) != `{"generation":2}` || len(got.Publishes) != 1 {
		t.Errorf("record after the new stage: stage %+v, publishes %+v", got.Stage, got.Publishes)
	}
}
