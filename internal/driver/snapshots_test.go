package driver

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/topology"
)

// createVol makes a volume of 16 MiB with data at 1 MiB (the images of
// these tests are never staged: no root needed).
func createVol(t *testing.T, d *Driver, name string, data []byte) {
	t.Helper()
	if _, err := d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}}); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(loop.ImagePath(d.opts.StateDir, model.KindProvisioned, name), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
}

func fromSnapshot(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func fromVolume(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

func imageHolds(t *testing.T, path string, at int64, want []byte) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, len(want))
	if _, err := f.ReadAt(got, at); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("%s does not hold the source's data at %d (%v)", path, at, err)
	}
}

func TestSnapshotRestoreClone(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	data := []byte("written before the snapshot")
	createVol(t, d, "src", data)

	req := &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: "src",
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{d.topology()}}}
	resp, err := d.CreateSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	s := resp.GetSnapshot()
	if s.GetSnapshotId() != "snap@node-a" || s.GetSourceVolumeId() != "src" || s.GetSizeBytes() != 16<<20 || !s.GetReadyToUse() || s.GetCreationTime() == nil {
		t.Fatalf("snapshot %v", s)
	}
	if len(s.GetAccessibleTopology()) != 1 || !proto.Equal(s.GetAccessibleTopology()[0], d.topology()) {
		t.Errorf("snapshot topology %v, want only this node's", s.GetAccessibleTopology())
	}
	imageHolds(t, loop.SnapshotImagePath(d.opts.StateDir, "snap"), 1<<20, data)
	// Writes to the volume after the snapshot do not reach it.
	createVolWrite(t, d, "src", []byte("written after the snapshot!"))
	imageHolds(t, loop.SnapshotImagePath(d.opts.StateDir, "snap"), 1<<20, data)

	again, err := d.CreateSnapshot(ctx, req)
	if err != nil || !proto.Equal(again.GetSnapshot(), s) {
		t.Fatalf("repeated CreateSnapshot: %v, %v; want the same snapshot", again, err)
	}
	createVol(t, d, "other", nil)
	if _, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: "other"}); errdefs.Code(err) != codes.AlreadyExists {
		t.Errorf("same name, other source: %v, want AlreadyExists", err)
	}

	// Restore, bigger than the snapshot.
	restore := &csi.CreateVolumeRequest{Name: "restored", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20}, VolumeContentSource: fromSnapshot("snap")}
	vr, err := d.CreateVolume(ctx, restore)
	if err != nil {
		t.Fatal(err)
	}
	if vr.GetVolume().GetCapacityBytes() != 32<<20 || vr.GetVolume().GetContentSource().GetSnapshot().GetSnapshotId() != "snap" {
		t.Fatalf("restored volume %v", vr.GetVolume())
	}
	img := loop.ImagePath(d.opts.StateDir, model.KindProvisioned, "restored")
	imageHolds(t, img, 1<<20, data)
	if fi, err := os.Stat(img); err != nil || fi.Size() != 32<<20 {
		t.Fatalf("restored image: %v, %v; want 32 MiB", fi, err)
	}
	if again, err := d.CreateVolume(ctx, restore); err != nil || !proto.Equal(again.GetVolume(), vr.GetVolume()) {
		t.Errorf("repeated restore: %v, %v", again, err)
	}
	blank := &csi.CreateVolumeRequest{Name: "restored", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: restore.CapacityRange}
	if _, err := d.CreateVolume(ctx, blank); errdefs.Code(err) != codes.AlreadyExists {
		t.Errorf("same name without the content source: %v, want AlreadyExists", err)
	}

	// Clone.
	vc, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "clone", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		VolumeContentSource: fromVolume("src")})
	if err != nil {
		t.Fatal(err)
	}
	if vc.GetVolume().GetCapacityBytes() != 16<<20 || vc.GetVolume().GetContentSource().GetVolume().GetVolumeId() != "src" {
		t.Fatalf("clone %v", vc.GetVolume())
	}
	imageHolds(t, loop.ImagePath(d.opts.StateDir, model.KindProvisioned, "clone"), 1<<20, []byte("written after the snapshot!"))

	// Deleting the source keeps the snapshot and the copies.
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "src"}); err != nil {
		t.Fatal(err)
	}
	imageHolds(t, loop.SnapshotImagePath(d.opts.StateDir, "snap"), 1<<20, data)
	if _, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "snap"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(loop.SnapshotImagePath(d.opts.StateDir, "snap")); !os.IsNotExist(err) {
		t.Errorf("snapshot image after DeleteSnapshot: %v", err)
	}
	if _, err := d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "snap"}); errdefs.Code(err) != codes.NotFound {
		t.Errorf("GetSnapshot after delete: %v, want NotFound", err)
	}
}

func createVolWrite(t *testing.T, d *Driver, name string, data []byte) {
	t.Helper()
	f, err := os.OpenFile(loop.ImagePath(d.opts.StateDir, model.KindProvisioned, name), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
}

func TestCopyRequestsGetTheRightCode(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	createVol(t, d, "src", []byte("x"))
	if _, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "src"}); err != nil {
		t.Fatal(err)
	}
	// A formatted source: its copies hold its filesystem.
	v, _ := d.records.Get("src")
	v.Format = &model.Format{FsType: "ext4", Done: true}
	if err := d.records.Put(v, journal.Durable); err != nil {
		t.Fatal(err)
	}
	vol := func(name string, size int64, cs *csi.VolumeContentSource, params map[string]string) func() error {
		return func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo},
				CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeContentSource: cs, Parameters: params})
			return err
		}
	}
	tests := []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"snapshot without name", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: "src"})
			return err
		}, codes.InvalidArgument},
		{"snapshot with a path for a name", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "../x", SourceVolumeId: "src"})
			return err
		}, codes.InvalidArgument},
		{"snapshot of nothing", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "n"})
			return err
		}, codes.InvalidArgument},
		{"snapshot of a missing volume", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "n", SourceVolumeId: "missing"})
			return err
		}, codes.NotFound},
		{"snapshot with an unknown parameter", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "n", SourceVolumeId: "src", Parameters: map[string]string{"x": "y"}})
			return err
		}, codes.InvalidArgument},
		{"snapshot for another node", func() error {
			_, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "n", SourceVolumeId: "src",
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{topology.Key: "node-b"}}}}})
			return err
		}, codes.ResourceExhausted},
		{"delete snapshot without id", func() error {
			_, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"delete a missing snapshot", func() error {
			_, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "missing"})
			return err
		}, codes.OK},
		{"restore a missing snapshot", vol("r", 0, fromSnapshot("missing"), nil), codes.NotFound},
		{"clone a missing volume", vol("r", 0, fromVolume("missing"), nil), codes.NotFound},
		{"clone itself", vol("src2", 0, fromVolume("src2"), nil), codes.InvalidArgument},
		{"empty content source", vol("r", 0, &csi.VolumeContentSource{}, nil), codes.InvalidArgument},
		{"restore smaller than the snapshot", vol("r", 8<<20, fromSnapshot("s"), nil), codes.OutOfRange},
		{"clone as another filesystem", vol("r", 0, fromVolume("src"), map[string]string{"fsType": "xfs"}), codes.InvalidArgument},
		{"list with a foreign token", func() error {
			_, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "invalid-token"})
			return err
		}, codes.Aborted},
		{"list volumes with a foreign token", func() error {
			_, err := d.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "invalid-token"})
			return err
		}, codes.Aborted},
		{"list with negative max", func() error {
			_, err := d.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: -1})
			return err
		}, codes.InvalidArgument},
		{"get a missing volume", func() error {
			_, err := d.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "missing"})
			return err
		}, codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := errdefs.Code(tt.call()); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
	if ents, _ := os.ReadDir(filepath.Join(d.opts.StateDir, "images", "provisioned")); len(ents) != 1 {
		t.Errorf("%d images after refused creates, want only the source's", len(ents))
	}
}

func TestListPages(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		createVol(t, d, n, nil)
		if _, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s-" + n, SourceVolumeId: n}); err != nil {
			t.Fatal(err)
		}
	}
	first, err := d.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2})
	if err != nil || len(first.GetEntries()) != 2 || first.GetNextToken() == "" {
		t.Fatalf("first page: %v, %v", first, err)
	}
	// The next page's first volume goes; the token still works.
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "c"}); err != nil {
		t.Fatal(err)
	}
	rest, err := d.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: first.GetNextToken()})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range append(first.GetEntries(), rest.GetEntries()...) {
		ids = append(ids, e.GetVolume().GetVolumeId())
	}
	if want := []string{"a", "b", "d", "e"}; !slices.Equal(ids, want) || rest.GetNextToken() != "" {
		t.Errorf("pages list %v (next %q), want %v", ids, rest.GetNextToken(), want)
	}

	bySource, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: "d"})
	if err != nil || len(bySource.GetEntries()) != 1 || bySource.GetEntries()[0].GetSnapshot().GetSnapshotId() != "s-d@node-a" {
		t.Errorf("snapshots of d: %v, %v", bySource, err)
	}
	byID, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: "s-b"})
	if err != nil || len(byID.GetEntries()) != 1 {
		t.Errorf("snapshot s-b: %v, %v", byID, err)
	}
	none, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: "../s-b"})
	if err != nil || len(none.GetEntries()) != 0 {
		t.Errorf("snapshot by an impossible id: %v, %v", none, err)
	}
	page1, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{MaxEntries: 3})
	if err != nil {
		t.Fatal(err)
	}
	page2, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: page1.GetNextToken(), MaxEntries: 3})
	if err != nil || len(page1.GetEntries())+len(page2.GetEntries()) != 5 || page2.GetNextToken() != "" {
		t.Errorf("snapshot pages: %d + %d entries (next %q), %v; want 5 in all", len(page1.GetEntries()), len(page2.GetEntries()), page2.GetNextToken(), err)
	}
}

// TestInterruptedCopiesAreUndone plants what a crash in the middle of a
// snapshot and of a clone leaves (records still Creating, a temp file of
// the copy, an image renamed into place but never recorded as done) and
// checks that the reconciler removes all of it and nothing else.
func TestInterruptedCopiesAreUndone(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	createVol(t, d, "src", []byte("x"))
	if _, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "kept", SourceVolumeId: "src"}); err != nil {
		t.Fatal(err)
	}
	state := d.opts.StateDir
	snapImg := loop.SnapshotImagePath(state, "cut")
	if err := d.records.PutSnapshot(&model.Snapshot{ID: "cut", SourceVolume: "src", Image: snapImg, Creating: true}); err != nil {
		t.Fatal(err)
	}
	must(t, os.WriteFile(filepath.Join(filepath.Dir(snapImg), ".cut.img.tmp-123"), []byte("half"), 0o600))
	cloneImg := loop.ImagePath(state, model.KindProvisioned, "clone")
	must(t, os.WriteFile(cloneImg, []byte("complete but unrecorded"), 0o600))
	if err := d.records.Put(&model.Volume{ID: "clone", Kind: model.KindProvisioned, Type: loop.Type, Image: cloneImg,
		Creating: true, ContentSource: &model.ContentSource{Volume: "src"}}, journal.Durable); err != nil {
		t.Fatal(err)
	}
	orphan := loop.SnapshotImagePath(state, "orphan")
	must(t, os.WriteFile(orphan, []byte("no record"), 0o600))

	if err := d.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{snapImg, cloneImg, orphan, filepath.Join(filepath.Dir(snapImg), ".cut.img.tmp-123")} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s is left after reconcile (%v)", p, err)
		}
	}
	if _, err := d.records.Snapshot("cut"); errdefs.Code(err) != codes.NotFound {
		t.Errorf("the interrupted snapshot's record: %v, want none", err)
	}
	if _, err := d.records.Get("clone"); errdefs.Code(err) != codes.NotFound {
		t.Errorf("the interrupted clone's record: %v, want none", err)
	}
	imageHolds(t, loop.SnapshotImagePath(state, "kept"), 1<<20, []byte("x"))
	list, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(list.GetEntries()) != 1 {
		t.Errorf("snapshots after reconcile: %v, %v; want only the complete one", list, err)
	}
	var rec map[string]any
	b, _ := os.ReadFile(filepath.Join(state, "snapshots", "kept.json"))
	if json.Unmarshal(b, &rec) != nil || rec["method"] == "" {
		t.Errorf("the kept snapshot's record %s names no copy method", b)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotsNameTheirNode (issue 37): a snapshot lives on the node that
// took it, and its ID says which ("<name>@<node>"), so that a node asked
// to restore another node's snapshot answers ResourceExhausted (the
// provisioner then reschedules the claim, where NotFound left it Pending
// for good: csi-driver-host-path #651) while a snapshot that exists
// nowhere stays NotFound, as CSI says. IDs without a node (taken before)
// are this node's.
func TestSnapshotsNameTheirNode(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	createVol(t, d, "src", []byte("x"))
	resp, err := d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "src"})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetSnapshot().GetSnapshotId()
	if id != "s@node-a" {
		t.Fatalf("snapshot ID %q, want s@node-a: the name and the node that holds it", id)
	}
	restore := func(name, snap string) error {
		_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			VolumeContentSource: fromSnapshot(snap)})
		return err
	}
	for _, tt := range []struct {
		snap string
		want codes.Code
	}{
		{id, codes.OK},
		{"s", codes.OK}, // taken before IDs named their node
		{"s@node-b", codes.ResourceExhausted},
		{"missing@node-a", codes.NotFound},
		{"missing", codes.NotFound},
		{"missing@node-b", codes.ResourceExhausted},
		{"@node-a", codes.NotFound},
	} {
		err := restore("r-"+strings.NewReplacer("@", "-at-").Replace(tt.snap), tt.snap)
		if got := errdefs.Code(err); got != tt.want {
			t.Errorf("restore from %q: %v (%v), want %v", tt.snap, got, err, tt.want)
		}
		if tt.want == codes.ResourceExhausted && (err == nil || !strings.Contains(err.Error(), "node-b")) {
			t.Errorf("restore from %q: %v; want the error to name the snapshot's node", tt.snap, err)
		}
	}
	if resp, err := d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id}); err != nil || resp.GetSnapshot().GetSnapshotId() != id {
		t.Errorf("GetSnapshot(%s) = %v, %v", id, resp, err)
	}
	if _, err := d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "s@node-b"}); errdefs.Code(err) != codes.NotFound {
		t.Errorf("GetSnapshot of another node's = %v, want NotFound here", err)
	}
	if resp, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: id}); err != nil || len(resp.GetEntries()) != 1 ||
		resp.GetEntries()[0].GetSnapshot().GetSnapshotId() != id {
		t.Errorf("ListSnapshots(%s) = %v, %v; want it", id, resp, err)
	}
	if resp, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: "s@node-b"}); err != nil || len(resp.GetEntries()) != 0 {
		t.Errorf("ListSnapshots of another node's = %v, %v; want none here", resp, err)
	}
	if _, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "s"}); errdefs.Code(err) != codes.NotFound {
		t.Errorf("GetSnapshot after DeleteSnapshot(%s) = %v, want NotFound", id, err)
	}
}
