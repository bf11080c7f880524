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
	f.w = w
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
