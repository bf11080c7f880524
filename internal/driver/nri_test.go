package driver

import (
	"context"
	"errors"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
)

func TestParseNRIAndMountGroup(t *testing.T) {
	for _, tc := range []struct {
		vctx    map[string]string
		want    bool
		wantErr bool
	}{{nil, false, false}, {map[string]string{"nri": "true"}, true, false}, {map[string]string{"nri": "false"}, false, false},
		{map[string]string{"nri": "1"}, false, true}, {map[string]string{"nri": "yes"}, false, true}} {
		got, err := parseNRI(tc.vctx)
		if got != tc.want || (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
			t.Errorf("parseNRI(%v) = %v, %v", tc.vctx, got, err)
		}
	}
	vctx := map[string]string{"nri": "true", "image": "/x"}
	if got := withoutDriverAttributes(vctx); len(got) != 1 || got["image"] != "/x" || len(vctx) != 2 {
		t.Errorf("withoutDriverAttributes: %v (input now %v)", got, vctx)
	}
	for s, want := range map[string]bool{"": false, "2000": true} {
		if _, set, err := parseMountGroup(s); set != want || err != nil {
			t.Errorf("parseMountGroup(%q) = %v, %v", s, set, err)
		}
	}
	for _, s := range []string{"wheel", "-1", "4294967296"} {
		if _, _, err := parseMountGroup(s); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("parseMountGroup(%q): %v, want InvalidArgument", s, err)
		}
	}
}

// Requests of the NRI hook that are malformed or name nothing get the
// right code, before anything is looked up or recorded.
func TestNRIBadInput(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	tgt := d.kubelet.root + "/pods/p/volumes/kubernetes.io~csi/pv/mount"
	prep := func(pub *api.PublishedVolume, c *api.Consumer) func() error {
		return func() error {
			_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{Published: pub, Consumer: c})
			return err
		}
	}
	ctr := &api.Consumer{ContainerId: "0123abcd", MountPoint: "/data"}
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"published without a container", prep(&api.PublishedVolume{TargetPath: tgt}, &api.Consumer{Pid: 1, MountPoint: "/data"}), codes.InvalidArgument},
		{"published naming nothing", prep(&api.PublishedVolume{}, ctr), codes.InvalidArgument},
		{"published at a relative path", prep(&api.PublishedVolume{TargetPath: "pods/../x"}, ctr), codes.InvalidArgument},
		{"bad container id", prep(&api.PublishedVolume{TargetPath: tgt}, &api.Consumer{ContainerId: "a/b", MountPoint: "/data"}), codes.InvalidArgument},
		{"no such publish", prep(&api.PublishedVolume{TargetPath: tgt}, ctr), codes.NotFound},
		{"no such device", prep(&api.PublishedVolume{DeviceMajor: 7, DeviceMinor: 99}, ctr), codes.NotFound},
		{"container consumer by volume id", func() error {
			_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: "v", StagingTargetPath: d.kubelet.root + "/plugins/x/globalmount",
				VolumeCapability: rwo, Consumer: &api.Consumer{Pid: 1, ContainerId: "0123abcd", MountPoint: "/data"}})
			return err
		}, codes.InvalidArgument},
		{"publish with nri: yes", func() error {
			_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: d.kubelet.root + "/plugins/x/globalmount",
				TargetPath: tgt, VolumeCapability: rwo, VolumeContext: map[string]string{"nri": "yes"}})
			return err
		}, codes.InvalidArgument},
		{"sync with nothing to release", func() error {
			resp, err := d.NodeSyncContainers(ctx, &api.NodeSyncContainersRequest{ContainerIds: []string{"a"}})
			if err == nil && resp.GetReleased() != 0 {
				t.Errorf("released %d claims of an empty journal", resp.GetReleased())
			}
			return err
		}, codes.OK},
	} {
		if got := errdefs.Code(tc.call()); got != tc.want {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}

// NodeSyncContainers releases the claims of containers the runtime no
// longer has, and stops once its caller gave up: the list it was given
// may no longer hold every live container (the hook registers again and
// sends a new one).
func TestNodeSyncContainersStopsWhenTheCallerGivesUp(t *testing.T) {
	d, _ := newTestDriver(t)
	if err := d.records.Put(&model.Volume{ID: "synced", Kind: model.KindProvisioned, Type: "loop", CapacityBytes: 1 << 20,
		Consumers: []model.Claim{{Consumer: plan.Consumer{ContainerID: "live", MountPoint: "/a"}},
			{Consumer: plan.Consumer{ContainerID: "gone", MountPoint: "/b"}}}}, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	containers := func() []string {
		t.Helper()
		v, err := d.records.Get("synced")
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, c := range v.Consumers {
			ids = append(ids, c.ContainerID)
		}
		return ids
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.NodeSyncContainers(cancelled, &api.NodeSyncContainersRequest{ContainerIds: []string{"live"}}); err == nil {
		t.Error("a sync whose caller gave up answered no error")
	}
	if got := containers(); len(got) != 2 {
		t.Errorf("a sync whose caller gave up released claims: consumers now %v", got)
	}
	resp, err := d.NodeSyncContainers(context.Background(), &api.NodeSyncContainersRequest{ContainerIds: []string{"live"}})
	if err != nil || resp.GetReleased() != 1 {
		t.Fatalf("sync = %v, %v; want 1 released", resp, err)
	}
	if got := containers(); len(got) != 1 || got[0] != "live" {
		t.Errorf("consumers after the sync %v, want [live]", got)
	}
}
