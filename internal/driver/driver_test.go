package driver

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/topology"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// recordingMounter fails the test if anything reaches it: the requests in
// these tests must be refused before any side effect.
type recordingMounter struct{ calls int }

func (m *recordingMounter) Mount(context.Context, []plan.Mount, plan.Consumer) error {
	m.calls++
	return nil
}

func (m *recordingMounter) Unmount(context.Context, []plan.Mount, plan.Consumer) error {
	m.calls++
	return nil
}

// testOptions completes opts as mountplan-plugin does (loopOptions).
func testOptions(t testing.TB, opts Options) Options {
	t.Helper()
	opts, err := loopOptions(opts)
	if err != nil {
		t.Fatal(err)
	}
	return opts
}

// loopOptions completes opts as mountplan-plugin does: a mounter in this
// process when opts names none, and the loop source over it, the default
// type.
func loopOptions(opts Options) (Options, error) {
	state, err := filepath.Abs(opts.StateDir)
	if err != nil {
		return opts, err
	}
	if opts.Node == nil {
		if opts.Node, err = mounter.NewNode(context.Background(), mounter.Options{StateDir: state, KubeletDir: opts.KubeletDir,
			RecordsDir: mounter.DefaultRecordsDir(state), Config: opts.Config}); err != nil {
			return opts, err
		}
	}
	ls := loop.New(state, opts.Node)
	ls.Metrics = opts.Metrics
	if opts.Config != nil {
		ls.ImageRoots = opts.Config.ImageRoots
	}
	opts.Sources = map[string]source.Source{loop.Type: ls}
	opts.DefaultType = loop.Type
	return opts, nil
}

func newTestDriver(t *testing.T) (*Driver, *recordingMounter) {
	t.Helper()
	m := &recordingMounter{}
	d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "node-a", StateDir: t.TempDir(), KubeletDir: t.TempDir(), Mounter: m}))
	if err != nil {
		t.Fatal(err)
	}
	return d, m
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

var rwo = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)

func TestBadInputGetsTheRightCode(t *testing.T) {
	d, m := newTestDriver(t)
	stg, tgt := d.kubelet.root+"/plugins/x/globalmount", d.kubelet.root+"/pods/p/mount"
	ctx := context.Background()
	tests := []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"stage without id", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{StagingTargetPath: stg, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"stage with traversal id", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "../../etc", StagingTargetPath: stg, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"stage with relative staging path", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "s/../x", VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"stage without capability", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: stg})
			return err
		}, codes.InvalidArgument},
		{"stage multi-node", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: stg,
				VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)})
			return err
		}, codes.InvalidArgument},
		{"stage unknown volume", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo})
			return err
		}, codes.NotFound},
		{"static image without roots", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo,
				VolumeContext: map[string]string{"type": "loop", "image": "/etc/passwd"}})
			return err
		}, codes.InvalidArgument},
		{"static unknown attribute", func() error {
			_, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo,
				VolumeContext: map[string]string{"type": "loop", "image": "/x.img", "binary": "/bin/sh"}})
			return err
		}, codes.InvalidArgument},
		{"create with unknown parameter", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				Parameters: map[string]string{"type": "loop", "bogus": "1"}})
			return err
		}, codes.InvalidArgument},
		{"create with other type", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				Parameters: map[string]string{"type": "nfs"}})
			return err
		}, codes.InvalidArgument},
		{"create with path name", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "../x", VolumeCapabilities: []*csi.VolumeCapability{rwo}})
			return err
		}, codes.InvalidArgument},
		{"create beyond limit", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30, LimitBytes: 1 << 30}})
			return err
		}, codes.OutOfRange},
		{"create xfs below minimum limit", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				Parameters: map[string]string{"fsType": "xfs"}, CapacityRange: &csi.CapacityRange{LimitBytes: 10 << 20}})
			return err
		}, codes.OutOfRange},
		{"create on another node", func() error {
			_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{topology.Key: "node-b"}}}}})
			return err
		}, codes.ResourceExhausted},
		{"publish not staged", func() error {
			_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: stg, TargetPath: tgt, VolumeCapability: rwo})
			return err
		}, codes.NotFound},
		{"prepare without consumer", func() error {
			_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"prepare with relative mount point", func() error {
			_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo,
				Consumer: &api.Consumer{Pid: 1, MountPoint: "../data"}})
			return err
		}, codes.InvalidArgument},
		{"prepare unknown volume", func() error {
			_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: "v", StagingTargetPath: stg, VolumeCapability: rwo,
				Consumer: &api.Consumer{Pid: 1, MountPoint: "/data"}})
			return err
		}, codes.NotFound},
		{"stats with relative path on unknown volume", func() error {
			_, err := d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: "some/path"})
			return err
		}, codes.NotFound},
		{"expand without path", func() error {
			_, err := d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v"})
			return err
		}, codes.InvalidArgument},
		{"validate unknown", func() error {
			_, err := d.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo}})
			return err
		}, codes.NotFound},
		{"ephemeral bad size", func() error {
			_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "csi-1", TargetPath: tgt, VolumeCapability: rwo,
				VolumeContext: map[string]string{"csi.storage.k8s.io/ephemeral": "true", "size": "-5Gi"}})
			return err
		}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := errdefs.Code(tt.call()); got != tt.want {
				t.Fatalf("code = %v, want %v", got, tt.want)
			}
		})
	}
	if m.calls != 0 {
		t.Fatalf("refused requests reached the mounter %d times", m.calls)
	}
	vols, err := d.records.List()
	if err != nil || len(vols) != 0 {
		t.Fatalf("refused requests left records: %v %v", vols, err)
	}
}

func TestIdempotentReleaseCalls(t *testing.T) {
	d, _ := newTestDriver(t)
	stg := d.kubelet.root + "/plugins/x/globalmount"
	ctx := context.Background()
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "gone", StagingTargetPath: stg}); err != nil {
		t.Fatalf("unstage of an unknown volume: %v", err)
	}
	if _, err := d.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: "gone", Consumer: &api.Consumer{Pid: 1, MountPoint: "/d"}}); err != nil {
		t.Fatalf("unprepare of an unknown volume: %v", err)
	}
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "gone"}); err != nil {
		t.Fatalf("delete of an unknown volume: %v", err)
	}
	target := d.kubelet.root + "/target"
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "gone", TargetPath: target}); err != nil {
		t.Fatalf("unpublish of an unknown volume: %v", err)
	}
}

func TestCreateVolumeIsIdempotentByName(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	req := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		Parameters: map[string]string{"type": "loop", "csi.storage.k8s.io/pvc/name": "data"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 20<<20 + 1}}
	first, err := d.CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := first.GetVolume().GetCapacityBytes(); got != 21<<20 {
		t.Fatalf("capacity %d, want rounded up to 21 MiB", got)
	}
	if first.GetVolume().GetAccessibleTopology()[0].GetSegments()[topology.Key] != "node-a" {
		t.Fatalf("topology: %v", first.GetVolume().GetAccessibleTopology())
	}
	again, err := d.CreateVolume(ctx, req)
	if err != nil || again.GetVolume().GetVolumeId() != first.GetVolume().GetVolumeId() {
		t.Fatalf("repeat: %v %v", again, err)
	}
	bigger := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}
	if _, err := d.CreateVolume(ctx, bigger); errdefs.Code(err) != codes.AlreadyExists {
		t.Fatalf("incompatible repeat: %v, want AlreadyExists", err)
	}
	xfs := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{rwo}, Parameters: map[string]string{"fsType": "xfs"}}
	if _, err := d.CreateVolume(ctx, xfs); errdefs.Code(err) != codes.AlreadyExists {
		t.Fatalf("other fsType: %v, want AlreadyExists", err)
	}
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-1"}); err != nil {
		t.Fatalf("second delete: %v", err)
	}
}

func TestConcurrentOperationIsAborted(t *testing.T) {
	d, _ := newTestDriver(t)
	stg := d.kubelet.root + "/plugins/x/globalmount"
	unlock, err := d.records.TryLock("v", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	_, err = d.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: stg})
	if errdefs.Code(err) != codes.Aborted {
		t.Fatalf("got %v, want Aborted", err)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1Gi": 1 << 30, "512Mi": 512 << 20, "1000": 1000, "2G": 2e9} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1Gi", "1.5Gi", "1Pi", "9999999999Ti"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) accepted", in)
		}
	}
}

// TestConsumerBound: a volume takes no consumer beyond MaxConsumers (the
// review's finding 6: nothing bounded them), with a clear code.
func TestConsumerBound(t *testing.T) {
	v := &model.Volume{ID: "v", Consumers: make([]model.Claim, MaxConsumers-1)}
	if err := roomForConsumer(v); err != nil {
		t.Fatalf("room for the last consumer: %v", err)
	}
	v.Consumers = append(v.Consumers, model.Claim{})
	if err := roomForConsumer(v); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("one consumer too many: %v, want ResourceExhausted", err)
	}
}
