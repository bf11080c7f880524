package resizer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
)

const (
	driverName  = "mountplan.csi.io"
	topologyKey = "topology.mountplan.csi.io/node"
	node        = "node-a"
)

// controller is the plugin's Controller service as far as the resizer uses it.
type controller struct {
	csi.ControllerClient
	mu    sync.Mutex
	calls []*csi.ControllerExpandVolumeRequest
	resp  *csi.ControllerExpandVolumeResponse
	err   error
}

func (c *controller) ControllerExpandVolume(_ context.Context, req *csi.ControllerExpandVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerExpandVolumeResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, req)
	return c.resp, c.err
}

func (c *controller) ncalls() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

func pv(name, driver, onNode string, capacity string) *v1.PersistentVolume {
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeSpec{
			Capacity:    v1.ResourceList{v1.ResourceStorage: resource.MustParse(capacity)},
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: driver, VolumeHandle: "handle-" + name, FSType: "ext4"}},
			NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchExpressions: []v1.NodeSelectorRequirement{{Key: topologyKey, Operator: v1.NodeSelectorOpIn, Values: []string{onNode}}},
			}}}},
			ClaimRef: &v1.ObjectReference{Namespace: "ns", Name: "claim-" + name},
		},
	}
}

func pvc(volume, want, have string) *v1.PersistentVolumeClaim {
	return &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "claim-" + volume},
		Spec: v1.PersistentVolumeClaimSpec{
			VolumeName: volume,
			Resources:  v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse(want)}},
		},
		Status: v1.PersistentVolumeClaimStatus{
			Phase:    v1.ClaimBound,
			Capacity: v1.ResourceList{v1.ResourceStorage: resource.MustParse(have)},
			Conditions: []v1.PersistentVolumeClaimCondition{
				{Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue}, // not the resizer's
			},
		},
	}
}

// fakeCore is the fake clientset's core client, which, like the clientset,
// cannot stream lists (informers would wait for one forever).
type fakeCore struct{ typedcorev1.CoreV1Interface }

func (fakeCore) IsWatchListSemanticsUnSupported() bool { return true }

type fixture struct {
	t    *testing.T
	ctx  context.Context
	kube *fake.Clientset
	ctl  *controller
	r    *Resizer
}

func newFixture(t *testing.T, ctl *controller, objs ...runtime.Object) *fixture {
	t.Helper()
	kube := fake.NewClientset(objs...)
	r, err := New(Options{DriverName: driverName, TopologyKey: topologyKey, NodeID: node, Kube: fakeCore{kube.CoreV1()}, Controller: ctl})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := r.start(ctx); err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, ctx: ctx, kube: kube, ctl: ctl, r: r}
}

// sync waits until the informer's cache shows the claim as the API server
// has it, runs Sync, and waits again.
func (f *fixture) sync(name string) error {
	f.t.Helper()
	f.caughtUp(name)
	err := f.r.Sync(f.ctx, "ns/"+name)
	f.caughtUp(name)
	return err
}

func (f *fixture) caughtUp(name string) {
	f.t.Helper()
	want := f.claim(name)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		got, gerr := f.r.pvcs.PersistentVolumeClaims("ns").Get(name)
		if gerr == nil && equality.Semantic.DeepEqual(got.Spec, want.Spec) && equality.Semantic.DeepEqual(got.Status, want.Status) {
			break
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("cache never caught up with claim %s", name)
		}
	}
}

func (f *fixture) claim(name string) *v1.PersistentVolumeClaim {
	f.t.Helper()
	c, err := f.kube.CoreV1().PersistentVolumeClaims("ns").Get(f.ctx, name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}

func (f *fixture) volume(name string) *v1.PersistentVolume {
	f.t.Helper()
	v, err := f.kube.CoreV1().PersistentVolumes().Get(f.ctx, name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return v
}

func condition(c *v1.PersistentVolumeClaim, typ v1.PersistentVolumeClaimConditionType) *v1.PersistentVolumeClaimCondition {
	for i := range c.Status.Conditions {
		if c.Status.Conditions[i].Type == typ {
			return &c.Status.Conditions[i]
		}
	}
	return nil
}

func storage(l v1.ResourceList) string {
	q := l[v1.ResourceStorage]
	return q.String()
}

func TestExpandThenKubeletsTurn(t *testing.T) {
	ctl := &controller{resp: &csi.ControllerExpandVolumeResponse{CapacityBytes: 2 << 30, NodeExpansionRequired: true}}
	f := newFixture(t, ctl, pv("v1", driverName, node, "1Gi"), pvc("v1", "2Gi", "1Gi"))
	if err := f.sync("claim-v1"); err != nil {
		t.Fatal(err)
	}
	if ctl.ncalls() != 1 {
		t.Fatalf("%d ControllerExpandVolume calls, want 1", ctl.ncalls())
	}
	req := ctl.calls[0]
	if req.VolumeId != "handle-v1" || req.CapacityRange.GetRequiredBytes() != 2<<30 ||
		req.VolumeCapability.GetMount().GetFsType() != "ext4" ||
		req.VolumeCapability.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER {
		t.Errorf("ControllerExpandVolume(%v)", req)
	}
	if got := storage(f.volume("v1").Spec.Capacity); got != "2Gi" {
		t.Errorf("PV capacity %s, want 2Gi", got)
	}
	c := f.claim("claim-v1")
	if st := c.Status.AllocatedResourceStatuses[v1.ResourceStorage]; st != v1.PersistentVolumeClaimNodeResizePending {
		t.Errorf("allocatedResourceStatuses %q, want NodeResizePending", st)
	}
	if got := storage(c.Status.AllocatedResources); got != "2Gi" {
		t.Errorf("allocatedResources %s, want 2Gi", got)
	}
	if got := storage(c.Status.Capacity); got != "1Gi" {
		t.Errorf("status capacity %s before kubelet grew the filesystem, want 1Gi", got)
	}
	if condition(c, v1.PersistentVolumeClaimFileSystemResizePending) == nil || condition(c, v1.PersistentVolumeClaimResizing) != nil {
		t.Errorf("conditions %+v, want FileSystemResizePending only", c.Status.Conditions)
	}
	if condition(c, v1.PersistentVolumeClaimVolumeModifyingVolume) == nil {
		t.Errorf("a condition that is not the resizer's was dropped: %+v", c.Status.Conditions)
	}
	// kubelet's turn: nothing more from the resizer.
	if err := f.sync("claim-v1"); err != nil || ctl.ncalls() != 1 {
		t.Fatalf("second sync: err %v, %d calls, want none more", err, ctl.ncalls())
	}
}

func TestExpandWithoutNodeStep(t *testing.T) {
	ctl := &controller{resp: &csi.ControllerExpandVolumeResponse{CapacityBytes: 3 << 30}}
	f := newFixture(t, ctl, pv("v1", driverName, node, "1Gi"), pvc("v1", "2Gi", "1Gi"))
	if err := f.sync("claim-v1"); err != nil {
		t.Fatal(err)
	}
	c := f.claim("claim-v1")
	// The plugin rounded up: the claim gets what the volume has.
	if got := storage(c.Status.Capacity); got != "3Gi" {
		t.Errorf("status capacity %s, want 3Gi", got)
	}
	if _, ok := c.Status.AllocatedResourceStatuses[v1.ResourceStorage]; ok || condition(c, v1.PersistentVolumeClaimResizing) != nil {
		t.Errorf("resize state left: %v %+v", c.Status.AllocatedResourceStatuses, c.Status.Conditions)
	}
	if err := f.sync("claim-v1"); err != nil || ctl.ncalls() != 1 {
		t.Fatalf("after completion: err %v, %d calls, want 1", err, ctl.ncalls())
	}
}

func TestNotOurs(t *testing.T) {
	ctl := &controller{resp: &csi.ControllerExpandVolumeResponse{CapacityBytes: 2 << 30}}
	f := newFixture(t, ctl,
		pv("other-node", driverName, "node-b", "1Gi"), pvc("other-node", "2Gi", "1Gi"),
		pv("other-driver", "other.csi.io", node, "1Gi"), pvc("other-driver", "2Gi", "1Gi"),
		pv("same-size", driverName, node, "1Gi"), pvc("same-size", "1Gi", "1Gi"),
	)
	for _, n := range []string{"claim-other-node", "claim-other-driver", "claim-same-size", "claim-missing"} {
		if err := f.r.Sync(f.ctx, "ns/"+n); err != nil {
			t.Errorf("%s: %v", n, err)
		}
	}
	if ctl.ncalls() != 0 {
		t.Errorf("%d ControllerExpandVolume calls for claims that are not this node's to grow", ctl.ncalls())
	}
}

func TestRefused(t *testing.T) {
	ctl := &controller{err: status.Error(codes.FailedPrecondition, "volume is static")}
	f := newFixture(t, ctl, pv("v1", driverName, node, "1Gi"), pvc("v1", "2Gi", "1Gi"))
	if err := f.sync("claim-v1"); err != nil {
		t.Fatalf("a final refusal must not be retried: %v", err)
	}
	c := f.claim("claim-v1")
	if st := c.Status.AllocatedResourceStatuses[v1.ResourceStorage]; st != v1.PersistentVolumeClaimControllerResizeInfeasible {
		t.Errorf("allocatedResourceStatuses %q, want ControllerResizeInfeasible", st)
	}
	if cond := condition(c, v1.PersistentVolumeClaimControllerResizeError); cond == nil || cond.Message == "" {
		t.Errorf("no ControllerResizeError condition with the reason: %+v", c.Status.Conditions)
	}
	if got := storage(f.volume("v1").Spec.Capacity); got != "1Gi" {
		t.Errorf("PV capacity %s after a refusal, want 1Gi", got)
	}
	if err := f.sync("claim-v1"); err != nil || ctl.ncalls() != 1 {
		t.Fatalf("the same size again: err %v, %d calls, want 1", err, ctl.ncalls())
	}
	// A new size is tried again.
	c.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("3Gi")
	if _, err := f.kube.CoreV1().PersistentVolumeClaims("ns").Update(f.ctx, c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ctl.err, ctl.resp = nil, &csi.ControllerExpandVolumeResponse{CapacityBytes: 3 << 30, NodeExpansionRequired: true}
	if err := f.sync("claim-v1"); err != nil || ctl.ncalls() != 2 {
		t.Fatalf("a new size: err %v, %d calls, want 2", err, ctl.ncalls())
	}
	if c := f.claim("claim-v1"); condition(c, v1.PersistentVolumeClaimControllerResizeError) != nil {
		t.Errorf("the old error condition stayed: %+v", c.Status.Conditions)
	}
}

func TestTransientError(t *testing.T) {
	ctl := &controller{err: status.Error(codes.Unavailable, "plugin restarting")}
	f := newFixture(t, ctl, pv("v1", driverName, node, "1Gi"), pvc("v1", "2Gi", "1Gi"))
	if err := f.sync("claim-v1"); err == nil {
		t.Fatal("a transient error must be retried")
	}
	c := f.claim("claim-v1")
	if st := c.Status.AllocatedResourceStatuses[v1.ResourceStorage]; st != v1.PersistentVolumeClaimControllerResizeInProgress {
		t.Errorf("allocatedResourceStatuses %q, want ControllerResizeInProgress", st)
	}
	ctl.err, ctl.resp = nil, &csi.ControllerExpandVolumeResponse{CapacityBytes: 2 << 30, NodeExpansionRequired: true}
	if err := f.sync("claim-v1"); err != nil || ctl.ncalls() != 2 {
		t.Fatalf("retry: err %v, %d calls, want 2", err, ctl.ncalls())
	}
	if st := f.claim("claim-v1").Status.AllocatedResourceStatuses[v1.ResourceStorage]; st != v1.PersistentVolumeClaimNodeResizePending {
		t.Errorf("after the retry: %q, want NodeResizePending", st)
	}
}

func TestBlockCapability(t *testing.T) {
	block := v1.PersistentVolumeBlock
	p := pv("v1", driverName, node, "1Gi")
	p.Spec.VolumeMode = &block
	p.Spec.AccessModes = []v1.PersistentVolumeAccessMode{v1.ReadWriteOncePod}
	c := capability(p)
	if c.GetBlock() == nil || c.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		t.Errorf("capability(block RWOP) = %v", c)
	}
}
