package forgetnode_test

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/mountplan/mountplan/internal/forgetnode"
	"github.com/mountplan/mountplan/internal/topology"
)

const driver = "mountplan.csi.io"

func pinned(nodes ...string) *corev1.VolumeNodeAffinity {
	a := &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{}}
	for _, n := range nodes {
		a.Required.NodeSelectorTerms = append(a.Required.NodeSelectorTerms, corev1.NodeSelectorTerm{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: topology.Key, Operator: corev1.NodeSelectorOpIn, Values: []string{n}}}})
	}
	return a
}

func pv(name, drv string, affinity *corev1.VolumeNodeAffinity, claim *corev1.PersistentVolumeClaim) *corev1.PersistentVolume {
	v := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name),
			Finalizers: []string{"kubernetes.io/pv-protection", forgetnode.ProvisionerFinalizer}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: name}},
			NodeAffinity:           affinity,
		},
		Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
	}
	if claim != nil {
		v.Spec.ClaimRef = &corev1.ObjectReference{Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID}
		claim.Spec.VolumeName = name
	}
	return v
}

func pvc(ns, name string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + ns + "-" + name)}}
}

func capacity(name, drv, node string) *storagev1.CSIStorageCapacity {
	return &storagev1.CSIStorageCapacity{
		ObjectMeta:   metav1.ObjectMeta{Namespace: "mountplan", Name: name, Labels: map[string]string{"csi.storage.k8s.io/drivername": drv}},
		NodeTopology: &metav1.LabelSelector{MatchLabels: map[string]string{topology.Key: node}},
	}
}

// TestForgetNode: of a gone node, the volumes pinned to it alone (a bound
// one with its claim, a released one whose claim is gone) and its
// capacities are found and deleted, the provisioner's finalizer taken off
// after the volume's delete, every delete conditional on the UID seen; another node's volumes,
// another driver's, and a volume that another node could serve are left.
func TestForgetNode(t *testing.T) {
	ctx := context.Background()
	bound, other, reused := pvc("apps", "data-0"), pvc("apps", "live"), pvc("apps", "reused")
	staleRef := pv("pv-released", driver, pinned("gone"), reused)
	reused.UID = "uid-made-again" // the name was taken by a new claim since
	objs := []runtime.Object{
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "live"}},
		pv("pv-bound", driver, pinned("gone"), bound), bound,
		staleRef, reused,
		pv("pv-live", driver, pinned("live"), other), other,
		pv("pv-other-driver", "other.csi.io", pinned("gone"), nil),
		pv("pv-either", driver, pinned("gone", "live"), nil),
		pv("pv-no-affinity", driver, nil, nil),
		capacity("cap-gone", driver, "gone"), capacity("cap-live", driver, "live"), capacity("cap-other", "other.csi.io", "gone"),
	}
	cs := fake.NewClientset(objs...)
	// As the API server does (registered first, so that the record of
	// deletes below sees each before it): a volume with finalizers is only marked for
	// deletion, and goes once the last one is taken off.
	pvs := corev1.SchemeGroupVersion.WithResource("persistentvolumes")
	cs.PrependReactor("delete", "persistentvolumes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		o, err := cs.Tracker().Get(pvs, "", a.(k8stesting.DeleteAction).GetName())
		if err != nil {
			return false, nil, nil
		}
		v := o.(*corev1.PersistentVolume).DeepCopy()
		if len(v.Finalizers) == 0 {
			return false, nil, nil
		}
		v.DeletionTimestamp = &metav1.Time{Time: time.Now()}
		return true, v, cs.Tracker().Update(pvs, v, "")
	})
	cs.PrependReactor("update", "persistentvolumes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		v := a.(k8stesting.UpdateAction).GetObject().(*corev1.PersistentVolume)
		if v.DeletionTimestamp != nil && len(v.Finalizers) == 0 {
			return true, v, cs.Tracker().Delete(pvs, "", v.Name)
		}
		return false, nil, nil
	})
	var deletes []string
	cs.PrependReactor("delete", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		d := a.(k8stesting.DeleteAction)
		uid := "-"
		if p := d.GetDeleteOptions().Preconditions; p != nil && p.UID != nil {
			uid = string(*p.UID)
		}
		deletes = append(deletes, a.GetResource().Resource+"/"+d.GetName()+" if "+uid)
		return false, nil, nil
	})

	if _, err := forgetnode.Make(ctx, cs, driver, "live"); !errors.Is(err, forgetnode.ErrNodeExists) {
		t.Fatalf("Make for a node that exists = %v, want ErrNodeExists", err)
	}
	p, err := forgetnode.Make(ctx, cs, driver, "gone")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, v := range p.Volumes {
		s := v.Name
		if v.Claim != nil {
			s += " <- " + v.Claim.String()
		}
		got = append(got, s)
	}
	if want := []string{"pv-bound <- apps/data-0", "pv-released"}; !slices.Equal(got, want) {
		t.Errorf("volumes of the gone node: %q, want %q", got, want)
	}
	if len(p.Capacities) != 1 || p.Capacities[0].Name != "cap-gone" {
		t.Errorf("capacities of the gone node: %v, want mountplan/cap-gone", p.Capacities)
	}
	var printed bytes.Buffer
	p.Print(&printed)
	for _, s := range []string{"persistentvolume pv-bound (64Mi, Bound), bound to claim apps/data-0", "persistentvolume pv-released (64Mi, Bound)\n", "csistoragecapacity mountplan/cap-gone"} {
		if !strings.Contains(printed.String(), s) {
			t.Errorf("the plan as printed lacks %q:\n%s", s, printed.String())
		}
	}

	if err := p.Apply(ctx, cs, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	wantDeletes := []string{
		"persistentvolumeclaims/data-0 if uid-apps-data-0", "persistentvolumes/pv-bound if uid-pv-bound",
		"persistentvolumes/pv-released if uid-pv-released", "csistoragecapacities/cap-gone if -",
	}
	if !slices.Equal(deletes, wantDeletes) {
		t.Errorf("deletes: %q, want %q", deletes, wantDeletes)
	}
	left, err := cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, v := range left.Items {
		if v.DeletionTimestamp == nil {
			names = append(names, v.Name)
		}
	}
	if want := []string{"pv-either", "pv-live", "pv-no-affinity", "pv-other-driver"}; !slices.Equal(names, want) {
		t.Errorf("volumes left: %q, want %q", names, want)
	}
	if _, err := cs.CoreV1().PersistentVolumeClaims("apps").Get(ctx, "reused", metav1.GetOptions{}); err != nil {
		t.Errorf("the claim made again under a released volume's old claim name: %v", err)
	}
	// The finalizer was taken off after the delete (another node's
	// provisioner adds it back to a volume still Bound and not being
	// deleted), and only it: pv-protection's stays.
	var updated []string
	for _, a := range cs.Actions() {
		if u, ok := a.(k8stesting.UpdateAction); ok && a.GetResource().Resource == "persistentvolumes" {
			v := u.GetObject().(*corev1.PersistentVolume)
			if v.DeletionTimestamp == nil {
				t.Errorf("the finalizer of %s was taken off before its delete", v.Name)
			}
			if slices.Contains(v.Finalizers, forgetnode.ProvisionerFinalizer) || !slices.Contains(v.Finalizers, "kubernetes.io/pv-protection") {
				t.Errorf("update of %s left finalizers %q, want only the provisioner's taken off", v.Name, v.Finalizers)
			}
			updated = append(updated, v.Name)
		}
	}
	if want := []string{"pv-bound", "pv-released"}; !slices.Equal(updated, want) {
		t.Errorf("volumes whose provisioner's finalizer was taken off: %q, want %q", updated, want)
	}
	if again, err := forgetnode.Make(ctx, cs, driver, "gone"); err != nil || !again.Empty() {
		t.Errorf("after Apply the gone node still leaves %+v (%v)", again, err)
	}
}
