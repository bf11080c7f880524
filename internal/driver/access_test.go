package driver

import (
	"context"
	"encoding/json"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
)

var (
	singleWriter = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
	multiWriter  = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
)

// TestCapabilitiesAdvertiseMultiWriter: the node and the controller both
// say SINGLE_NODE_MULTI_WRITER, which is what makes a CO send the two new
// access modes (ReadWriteOncePod, ReadWriteOnce) instead of
// SINGLE_NODE_WRITER.
func TestCapabilitiesAdvertiseMultiWriter(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	node, err := d.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(node.GetCapabilities(), func(c *csi.NodeServiceCapability) bool {
		return c.GetRpc().GetType() == csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER
	}) {
		t.Errorf("node capabilities lack SINGLE_NODE_MULTI_WRITER: %v", node.GetCapabilities())
	}
	ctrl, err := d.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(ctrl.GetCapabilities(), func(c *csi.ControllerServiceCapability) bool {
		return c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER
	}) {
		t.Errorf("controller capabilities lack SINGLE_NODE_MULTI_WRITER: %v", ctrl.GetCapabilities())
	}
}

// TestAccessModesAccepted: CreateVolume and ValidateVolumeCapabilities take
// every SINGLE_NODE_* mode, SINGLE_NODE_WRITER included (CSI keeps it for
// older COs), and still refuse multi-node ones.
func TestAccessModesAccepted(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	// A volume made already: a repeated CreateVolume answers from its
	// record, after validating the request, and makes no image.
	if err := d.records.Put(&model.Volume{ID: "modes", Kind: model.KindProvisioned, Type: "loop", CapacityBytes: 1 << 20,
		FsType: d.opts.Config.DefaultFsType}, journal.Durable); err != nil {
		t.Fatal(err)
	}
	for mode, ok := range map[csi.VolumeCapability_AccessMode_Mode]bool{
		csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER:        true,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:   true,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER: true,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:  true,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:   false,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:    false,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			caps := []*csi.VolumeCapability{mountCap(mode)}
			resp, err := d.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "modes", VolumeCapabilities: caps})
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.GetConfirmed() != nil; got != ok {
				t.Errorf("ValidateVolumeCapabilities confirmed %t, want %t (%s)", got, ok, resp.GetMessage())
			}
			_, err = d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "modes", VolumeCapabilities: caps,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
			if want := map[bool]codes.Code{true: codes.OK, false: codes.InvalidArgument}[ok]; errdefs.Code(err) != want {
				t.Errorf("CreateVolume: %v, want %v", err, want)
			}
		})
	}
}

// TestSingleWriterPublish follows CSI's table for a second
// NodePublishVolume of one volume on one node: a SINGLE_NODE_SINGLE_WRITER
// publish (ReadWriteOncePod) stands alone, whichever side asked for it;
// SINGLE_NODE_MULTI_WRITER and SINGLE_NODE_WRITER allow several targets;
// another mode at the same target is AlreadyExists. A refused publish
// reaches neither the mounter nor the record.
func TestSingleWriterPublish(t *testing.T) {
	d, m := newTestDriver(t)
	d.sources["fake"] = &fakeSource{}
	stg := d.kubelet.root + "/plugins/x/globalmount"
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Type: "fake",
		Stage: &model.Stage{Phase: model.PhaseStaged, StagingPath: stg, Source: json.RawMessage(`{}`)}}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	target := func(name string) string { return d.kubelet.root + "/pods/" + name + "/mount" }
	publish := func(name string, c *csi.VolumeCapability) error {
		_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: stg,
			TargetPath: target(name), VolumeCapability: c})
		return err
	}
	unpublish := func(name string) error {
		_, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target(name)})
		return err
	}
	steps := []struct {
		name string
		call func() error
		want codes.Code
		// published is what the record holds afterwards.
		published []string
	}{
		{"single writer at a", func() error { return publish("a", singleWriter) }, codes.OK, []string{"a"}},
		{"single writer at a again", func() error { return publish("a", singleWriter) }, codes.OK, []string{"a"}},
		{"multi writer at a", func() error { return publish("a", multiWriter) }, codes.AlreadyExists, []string{"a"}},
		{"single writer at b", func() error { return publish("b", singleWriter) }, codes.FailedPrecondition, []string{"a"}},
		{"multi writer at b", func() error { return publish("b", multiWriter) }, codes.FailedPrecondition, []string{"a"}},
		{"single node writer at b", func() error { return publish("b", rwo) }, codes.FailedPrecondition, []string{"a"}},
		{"unpublish a", func() error { return unpublish("a") }, codes.OK, nil},
		{"multi writer at b", func() error { return publish("b", multiWriter) }, codes.OK, []string{"b"}},
		{"multi writer at c", func() error { return publish("c", multiWriter) }, codes.OK, []string{"b", "c"}},
		{"single node writer at d", func() error { return publish("d", rwo) }, codes.OK, []string{"b", "c", "d"}},
		{"single writer at a", func() error { return publish("a", singleWriter) }, codes.FailedPrecondition, []string{"b", "c", "d"}},
		{"single writer at b", func() error { return publish("b", singleWriter) }, codes.AlreadyExists, []string{"b", "c", "d"}},
	}
	for _, s := range steps {
		before := m.calls
		err := s.call()
		if got := errdefs.Code(err); got != s.want {
			t.Fatalf("%s: %v (%v), want %v", s.name, got, err, s.want)
		}
		if s.want != codes.OK && m.calls != before {
			t.Fatalf("%s: refused, yet the mounter was asked", s.name)
		}
		rec, err := d.records.Get("v")
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, p := range rec.Publishes {
			got = append(got, p.TargetPath)
		}
		var want []string
		for _, n := range s.published {
			want = append(want, target(n))
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: published at %v, want %v", s.name, got, want)
		}
	}
}

// TestSingleWriterRecorded: the single-writer mark survives the journal, so
// that a restarted plugin still refuses a second target.
func TestSingleWriterRecorded(t *testing.T) {
	v := &model.Volume{ID: "v", Publishes: []model.Publish{{TargetPath: "/k/pods/a/mount", SingleWriter: true}}}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var back model.Volume
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if err := checkPublishes(&back, "/k/pods/b/mount", capability{}); errdefs.Code(err) != codes.FailedPrecondition {
		t.Fatalf("after a round trip through JSON: %v, want FailedPrecondition", err)
	}
}
