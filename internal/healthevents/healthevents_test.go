package healthevents

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

const driver, node = "mountplan.csi.io", "node-a"

// plugin answers NodeGetVolumeHealth from a map: a volume it does not
// hold is NotFound, as the plugin's answer for a volume staged elsewhere.
type plugin struct {
	csi.NodeClient
	health map[string][]*csi.VolumeHealth_VolumeHealthEntry
}

func (p *plugin) NodeGetVolumeHealth(_ context.Context, req *csi.NodeGetVolumeHealthRequest, _ ...grpc.CallOption) (*csi.NodeGetVolumeHealthResponse, error) {
	h, ok := p.health[req.GetVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", req.GetVolumeId())
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: &csi.VolumeHealth{VolumeId: req.GetVolumeId(), HealthStatuses: h}}, nil
}

type event struct{ on, kind, reason, msg string }

// recorder keeps the Events and whom they are on (kind/namespace/name/uid).
type recorder struct{ events []event }

func (r *recorder) Event(obj runtime.Object, kind, reason, msg string) {
	ref := obj.(*v1.ObjectReference)
	r.events = append(r.events, event{fmt.Sprintf("%s/%s/%s/%s", ref.Kind, ref.Namespace, ref.Name, ref.UID), kind, reason, msg})
}

func (r *recorder) Eventf(obj runtime.Object, kind, reason, format string, args ...any) {
	r.Event(obj, kind, reason, fmt.Sprintf(format, args...))
}

func (r *recorder) AnnotatedEventf(obj runtime.Object, _ map[string]string, kind, reason, format string, args ...any) {
	r.Event(obj, kind, reason, fmt.Sprintf(format, args...))
}

func (r *recorder) take() []event {
	e := r.events
	r.events = nil
	return e
}

type fixture struct {
	w      *Watcher
	pvcs   cache.Indexer
	plugin *plugin
	rec    *recorder
	now    time.Time
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pvcs := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	pvs := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	claim := func(name, pv string) {
		must(t, pvcs.Add(&v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, UID: types.UID("uid-" + name)},
			Spec: v1.PersistentVolumeClaimSpec{VolumeName: pv}}))
	}
	volume := func(name, drv, handle string) {
		must(t, pvs.Add(&v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: handle}}}}))
	}
	claim("data", "pv-data")
	volume("pv-data", driver, "vol-data")
	claim("other", "pv-other")
	volume("pv-other", "other.csi.io", "vol-other")
	claim("unbound", "")

	f := &fixture{plugin: &plugin{health: map[string][]*csi.VolumeHealth_VolumeHealthEntry{"vol-data": nil, "vol-other": nil}},
		rec: &recorder{}, now: time.Unix(1000, 0)}
	w, err := New(Options{DriverName: driver, NodeID: node, Kube: fake.NewClientset().CoreV1(), Node: f.plugin,
		PVCs: corelisters.NewPersistentVolumeClaimLister(pvcs), PVs: corelisters.NewPersistentVolumeLister(pvs),
		Recorder: f.rec, Now: func() time.Time { return f.now }})
	if err != nil {
		t.Fatal(err)
	}
	f.w, f.pvcs = w, pvcs
	f.pod("web-1", v1.PodRunning, "data", "unbound")
	f.pod("web-2", v1.PodRunning, "data", "data") // the claim twice: one Event
	f.pod("other", v1.PodRunning, "other")
	f.pod("done", v1.PodSucceeded, "data")
	return f
}

func (f *fixture) pod(name string, phase v1.PodPhase, claims ...string) {
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, UID: types.UID("uid-" + name)},
		Spec: v1.PodSpec{NodeName: node}, Status: v1.PodStatus{Phase: phase}}
	for i, c := range claims {
		p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: fmt.Sprint("v", i),
			VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
	}
	_ = f.w.informer.GetIndexer().Add(p)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) abnormal(handle string) {
	f.plugin.health[handle] = []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "DaemonDown", Message: "squashfuse exited"}}
}

// wantOn checks that one Event of kind and reason went to each of whom,
// and no other Event.
func wantOn(t *testing.T, got []event, kind, reason, msgPart string, whom ...string) {
	t.Helper()
	if len(got) != len(whom) {
		t.Fatalf("%d events, want %d (%s on %v): %+v", len(got), len(whom), reason, whom, got)
	}
	for i, e := range got {
		if e.on != whom[i] || e.kind != kind || e.reason != reason || !strings.Contains(e.msg, msgPart) {
			t.Errorf("event %d: %+v, want %s %s on %s with %q", i, e, kind, reason, whom[i], msgPart)
		}
	}
}

var dataUsers = []string{"PersistentVolumeClaim/app/data/uid-data", "Pod/app/web-1/uid-web-1", "Pod/app/web-2/uid-web-2"}

func TestAbnormalThenHealedOnClaimAndPods(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("healthy volumes made events: %+v", got)
	}

	f.abnormal("vol-data")
	f.abnormal("vol-other") // another driver's: never asked about
	f.w.Probe(ctx)
	// Pods are listed in no set order: sort what went to them.
	got := sortByWhom(f.rec.take())
	wantOn(t, got, v1.EventTypeWarning, ReasonAbnormal, "volume vol-data on node node-a is abnormal: INACCESSIBLE (DaemonDown): squashfuse exited", dataUsers...)

	f.now = f.now.Add(5 * time.Second)
	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("a volume still abnormal for the same reason made events again: %+v", got)
	}

	f.now = f.now.Add(7300 * time.Millisecond)
	f.plugin.health["vol-data"] = nil
	f.w.Probe(ctx)
	wantOn(t, sortByWhom(f.rec.take()), v1.EventTypeNormal, ReasonNormal, "healthy again, 12.3s after it was found abnormal (INACCESSIBLE (DaemonDown)", dataUsers...)

	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("a healed volume made events again: %+v", got)
	}
}

func TestNewReasonIsTold(t *testing.T) {
	f := newFixture(t)
	f.abnormal("vol-data")
	f.w.Probe(context.Background())
	f.rec.take()
	f.plugin.health["vol-data"] = []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "RestartFailed", Message: "image gone"}}
	f.now = f.now.Add(time.Minute)
	f.w.Probe(context.Background())
	wantOn(t, sortByWhom(f.rec.take()), v1.EventTypeWarning, ReasonAbnormal, "RestartFailed", dataUsers...)
	f.plugin.health["vol-data"] = nil
	f.now = f.now.Add(time.Minute)
	f.w.Probe(context.Background())
	// Abnormal since the first finding, not since the reason changed.
	wantOn(t, sortByWhom(f.rec.take()), v1.EventTypeNormal, ReasonNormal, "2m0s after", dataUsers...)
}

// A volume the plugin does not know (staged on no node here yet, or the
// plugin not answering) tells nothing; a volume no pod uses any more is
// forgotten, so that its next user does not get a stale heal.
func TestUnknownAndUnusedVolumesTellNothing(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	delete(f.plugin.health, "vol-data")
	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("a volume the plugin does not hold made events: %+v", got)
	}

	f.abnormal("vol-data")
	f.w.Probe(ctx)
	f.rec.take()
	for _, name := range []string{"web-1", "web-2", "done"} {
		must(t, f.w.informer.GetIndexer().Delete(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name}}))
	}
	f.w.Probe(ctx)
	f.plugin.health["vol-data"] = nil
	f.pod("web-3", v1.PodRunning, "data")
	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("a volume abnormal while no pod used it made events: %+v", got)
	}
}

// sortByWhom orders Events by whom they are on: the claim
// ("PersistentVolumeClaim/...") before the pods ("Pod/..."), the pods by
// name, a stable order for wantOn.
func sortByWhom(es []event) []event {
	slices.SortFunc(es, func(a, b event) int { return strings.Compare(a.on, b.on) })
	return es
}

// InlineHandle is kubelet's ID of an inline volume: csi- and the sha256
// of the pod's UID followed by the volume's name (sha256sum of the two).
func TestInlineHandleIsKubelets(t *testing.T) {
	const want = "csi-afcd84de6f64c12fd3d2b579bd8d3bd02563544f2e173a6417ae19668054653e"
	if got := InlineHandle("0d4f9c1e-7b1a-4a55-9f8e-2c3b5d6e7f80", "scratch"); got != want {
		t.Errorf("InlineHandle = %s, want %s", got, want)
	}
}

// A CSI inline volume of the driver has no claim: its pod gets the Events,
// which name the pod's volume; another driver's inline volume is never
// asked about.
func TestInlineVolumeEventsOnItsPod(t *testing.T) {
	f := newFixture(t)
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "scratchy", UID: "uid-scratchy"},
		Spec: v1.PodSpec{NodeName: node, Volumes: []v1.Volume{
			{Name: "scratch", VolumeSource: v1.VolumeSource{CSI: &v1.CSIVolumeSource{Driver: driver}}},
			{Name: "theirs", VolumeSource: v1.VolumeSource{CSI: &v1.CSIVolumeSource{Driver: "other.csi.io"}}},
		}}, Status: v1.PodStatus{Phase: v1.PodRunning}}
	must(t, f.w.informer.GetIndexer().Add(p))
	mine, theirs := InlineHandle("uid-scratchy", "scratch"), InlineHandle("uid-scratchy", "theirs")
	f.plugin.health[mine], f.plugin.health[theirs] = nil, nil
	ctx := context.Background()
	f.w.Probe(ctx)
	if got := f.rec.take(); len(got) != 0 {
		t.Fatalf("a healthy inline volume made events: %+v", got)
	}
	f.abnormal(mine)
	f.abnormal(theirs)
	f.w.Probe(ctx)
	wantOn(t, f.rec.take(), v1.EventTypeWarning, ReasonAbnormal,
		"inline volume scratch ("+mine+") on node node-a is abnormal: INACCESSIBLE (DaemonDown)", "Pod/app/scratchy/uid-scratchy")
	f.now = f.now.Add(3 * time.Second)
	f.plugin.health[mine] = nil
	f.w.Probe(ctx)
	wantOn(t, f.rec.take(), v1.EventTypeNormal, ReasonNormal, "healthy again, 3s after", "Pod/app/scratchy/uid-scratchy")
}

// The claim's status.healthStatus says what the Events say: the plugin's
// conditions, since when, while the volume is abnormal; nothing once it
// heals, once no pod here uses it, or (written by an earlier run) when
// the watcher finds it healthy.
func TestClaimHealthStatus(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	claims := f.w.opts.Kube.PersistentVolumeClaims("app")
	_, err := claims.Create(ctx, &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "data", UID: "uid-data"}}, metav1.CreateOptions{})
	must(t, err)
	health := func() *v1.VolumeHealthStatus {
		t.Helper()
		pvc, err := claims.Get(ctx, "data", metav1.GetOptions{})
		must(t, err)
		return pvc.Status.HealthStatus
	}

	f.abnormal("vol-data")
	f.w.Probe(ctx)
	want := &v1.VolumeHealthStatus{LastTransitionTime: metav1.NewTime(f.now),
		HealthConditions: []v1.VolumeHealthCondition{{Status: v1.VolumeHealthInaccessible, Reason: "DaemonDown", Message: "squashfuse exited"}}}
	if got := health(); got == nil || !got.LastTransitionTime.Equal(&want.LastTransitionTime) || !slices.Equal(got.HealthConditions, want.HealthConditions) {
		t.Errorf("health status of the claim of an abnormal volume: %+v, want %+v", got, want)
	}
	f.plugin.health["vol-data"] = nil
	f.w.Probe(ctx)
	if got := health(); got != nil {
		t.Errorf("health status of the claim of a healed volume: %+v, want none", got)
	}

	// Abnormal, then no pod here uses it: the claim says nothing.
	f.abnormal("vol-data")
	f.w.Probe(ctx)
	if health() == nil {
		t.Fatal("no health status on the claim of an abnormal volume")
	}
	for _, name := range []string{"web-1", "web-2", "done"} {
		must(t, f.w.informer.GetIndexer().Delete(&v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name}}))
	}
	f.w.Probe(ctx)
	if got := health(); got != nil {
		t.Errorf("health status of the claim no pod here uses: %+v, want none", got)
	}
}

// What an earlier run wrote on a claim is cleared once the volume is
// found healthy.
func TestStaleClaimHealthStatusCleared(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	stale := &v1.VolumeHealthStatus{HealthConditions: []v1.VolumeHealthCondition{{Status: v1.VolumeHealthDegraded, Reason: "Old"}}}
	pvc := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "data", UID: "uid-data"},
		Spec: v1.PersistentVolumeClaimSpec{VolumeName: "pv-data"}, Status: v1.PersistentVolumeClaimStatus{HealthStatus: stale}}
	_, err := f.w.opts.Kube.PersistentVolumeClaims("app").Create(ctx, pvc, metav1.CreateOptions{})
	must(t, err)
	must(t, f.pvcs.Update(pvc)) // the watcher's cache sees it too
	f.w.Probe(ctx)
	got, err := f.w.opts.Kube.PersistentVolumeClaims("app").Get(ctx, "data", metav1.GetOptions{})
	must(t, err)
	if got.Status.HealthStatus != nil {
		t.Errorf("a healthy volume's claim keeps an earlier run's health status: %+v", got.Status.HealthStatus)
	}
	if ev := f.rec.take(); len(ev) != 0 {
		t.Errorf("clearing an earlier run's status made events: %+v", ev)
	}
}
