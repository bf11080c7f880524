package driver

import (
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/volview"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// stagedFake records a volume "v" of the fake source, staged, with pubs.
func stagedFake(t *testing.T, d *Driver, pubs []model.Publish, claims []model.Claim) string {
	t.Helper()
	d.sources["fake"] = &fakeSource{}
	stg := d.kubelet.root + "/plugins/x/globalmount"
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Type: "fake",
		Stage:     &model.Stage{Phase: model.PhaseStaged, StagingPath: stg, Source: json.RawMessage(`{}`)},
		Publishes: pubs, Consumers: claims}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	return stg
}

// consumersOf lists volume id's consumers as the listing shows them.
func consumersOf(t *testing.T, d *Driver, id string) []volview.Consumer {
	t.Helper()
	for _, v := range d.Volumes(context.Background()).Volumes {
		if v.ID == id {
			return v.Consumers
		}
	}
	t.Fatalf("volume %s is not listed", id)
	return nil
}

// TestPublishRecordsPod: the pod kubelet names in volume_context
// (podInfoOnMount) is recorded with the publish and listed; a publish
// without it is listed with the pod UID of its target path; a pod name no
// Kubernetes object has is InvalidArgument and recorded nowhere.
func TestPublishRecordsPod(t *testing.T) {
	d, _ := newTestDriver(t)
	stg := stagedFake(t, d, nil, nil)
	ctx := context.Background()
	target := func(uid string) string {
		return d.kubelet.root + "/pods/" + uid + "/volumes/kubernetes.io~csi/pv-1/mount"
	}
	publish := func(uid string, vc map[string]string) error {
		_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: stg,
			TargetPath: target(uid), VolumeCapability: rwo, VolumeContext: vc})
		return err
	}
	if err := publish("uid-a", map[string]string{ctxPodNamespace: "shop", ctxPodName: "web-0", ctxPodUID: "uid-a",
		"csi.storage.k8s.io/serviceAccount.name": "default"}); err != nil {
		t.Fatal(err)
	}
	if err := publish("uid-b", nil); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []map[string]string{
		{ctxPodNamespace: "shop", ctxPodName: "web/../0"},
		{ctxPodName: "web 0"},
		{ctxPodUID: strings.Repeat("u", maxPodField+1)},
		{ctxPodNamespace: "shop\n"},
	} {
		if err := publish("uid-c", bad); errdefs.Code(err) != codes.InvalidArgument {
			t.Errorf("publish with %q: %v, want InvalidArgument", bad, err)
		}
	}
	rec, err := d.records.Get("v")
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Publishes) != 2 || rec.Publishes[0].Pod != (model.Pod{Namespace: "shop", Name: "web-0", UID: "uid-a"}) || rec.Publishes[1].Pod != (model.Pod{}) {
		t.Fatalf("publishes recorded: %+v", rec.Publishes)
	}
	got := consumersOf(t, d, "v")
	want := []*volview.Pod{{Namespace: "shop", Name: "web-0", UID: "uid-a"}, {UID: "uid-b"}}
	if len(got) != len(want) {
		t.Fatalf("consumers %+v", got)
	}
	for i := range want {
		if !reflect.DeepEqual(got[i].Pod, want[i]) {
			t.Errorf("consumer %d: pod %+v, want %+v", i, got[i].Pod, want[i])
		}
	}
}

// TestPrepareRecordsPod: the NRI hook's pod and container are recorded
// with a new claim, added to a claim recorded before pods were (the
// plugin's records of an older version), and listed; a bad name is
// InvalidArgument.
func TestPrepareRecordsPod(t *testing.T) {
	d, _ := newTestDriver(t)
	tgt := d.kubelet.root + "/pods/uid-a/volumes/kubernetes.io~csi/pv-1/mount"
	old := model.Claim{Consumer: plan.Consumer{MountPoint: "/old", ContainerID: "c-old"},
		Mounts: []plan.Mount{{Type: "tmpfs", Source: "tmpfs"}}}
	stagedFake(t, d, []model.Publish{{TargetPath: tgt, NRI: true}}, []model.Claim{old})
	ctx := context.Background()
	prepare := func(ctr, mp string, pod *api.PodRef) error {
		_, err := d.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{Published: &api.PublishedVolume{TargetPath: tgt},
			Consumer: &api.Consumer{ContainerId: ctr, MountPoint: mp}, Pod: pod})
		return err
	}
	web := &api.PodRef{Namespace: "shop", Name: "web-0", Uid: "uid-a", Container: "app"}
	if err := prepare("c-new", "/data", web); err != nil {
		t.Fatal(err)
	}
	if err := prepare("c-old", "/old", &api.PodRef{Namespace: "shop", Name: "web-0", Uid: "uid-a", Container: "init"}); err != nil {
		t.Fatal(err)
	}
	if err := prepare("c-bad", "/data", &api.PodRef{Namespace: "shop", Name: "web-0", Container: "a/b"}); errdefs.Code(err) != codes.InvalidArgument {
		t.Errorf("a container named a/b: %v, want InvalidArgument", err)
	}
	// A repeated prepare keeps the pod it recorded.
	if err := prepare("c-new", "/data", nil); err != nil {
		t.Fatal(err)
	}
	rec, err := d.records.Get("v")
	if err != nil {
		t.Fatal(err)
	}
	pods := map[string]model.Pod{}
	for _, c := range rec.Consumers {
		pods[c.ContainerID] = c.Pod
	}
	want := map[string]model.Pod{
		"c-old": {Namespace: "shop", Name: "web-0", UID: "uid-a", Container: "init"},
		"c-new": {Namespace: "shop", Name: "web-0", UID: "uid-a", Container: "app"},
	}
	if !reflect.DeepEqual(pods, want) {
		t.Fatalf("claims' pods %+v, want %+v", pods, want)
	}
	var shown []string
	for _, c := range consumersOf(t, d, "v") {
		if c.Kind == volview.KindContainer {
			shown = append(shown, c.Pod.String())
		}
	}
	if !reflect.DeepEqual(shown, []string{"shop/web-0/init", "shop/web-0/app"}) {
		t.Errorf("listed container pods %q", shown)
	}
}

// TestPodRecordsReadBack: a record written before pods were reads with
// none, and one with a pod keeps it through the journal's JSON.
func TestPodRecordsReadBack(t *testing.T) {
	var v model.Volume
	old := `{"id":"v","publishes":[{"targetPath":"/k/pods/a/mount","mounts":null}],"consumers":[{"pid":3,"mountPoint":"/d","nsInode":9,"mounts":null}]}`
	if err := json.Unmarshal([]byte(old), &v); err != nil {
		t.Fatal(err)
	}
	if v.Publishes[0].Pod != (model.Pod{}) || v.Consumers[0].Pod != (model.Pod{}) || v.Consumers[0].PID != 3 {
		t.Fatalf("old record: %+v", v)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), `"pod"`) {
		t.Errorf("a record without a pod writes one: %s", b)
	}
	v.Consumers[0].Pod = model.Pod{Namespace: "n", Name: "p", Container: "c"}
	b, err = json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var back model.Volume
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Consumers[0].Pod != v.Consumers[0].Pod {
		t.Fatalf("pod lost in the journal's JSON: %s", b)
	}
}
