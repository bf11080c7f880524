// Package forgetnode lets go of what a node that is gone for good leaves in
// the API: mountplan's volumes are node-local, so once the node is deleted
// its PersistentVolumes can never be mounted or deleted again. The
// external-provisioner that would delete them ran on that node alone
// (distributed provisioning), so each keeps its finalizer, and its claim
// holds a StatefulSet's pod Pending for ever; the node's
// CSIStorageCapacity objects stay too. The operator's command
// (kubectl mountplan forget-node) shows what is left, then, when told to,
// deletes the claims, releases and deletes the volumes, and deletes the
// capacities, with the operator's own credentials: nothing on the nodes
// gets the right to delete volumes cluster-wide.
package forgetnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/mountplan/mountplan/internal/topology"
)

// ProvisionerFinalizer is what external-provisioner puts on a volume it
// made, to delete the volume's storage before the object goes.
const ProvisionerFinalizer = "external-provisioner.volume.kubernetes.io/finalizer"

// driverLabel is the label external-provisioner gives its capacities.
const driverLabel = "csi.storage.k8s.io/drivername"

// ErrNodeExists refuses to forget a node that is still there: its volumes
// and their data may be in use.
var ErrNodeExists = errors.New("the node still exists")

// Plan is what a gone node left of a driver's objects.
type Plan struct {
	Node, Driver string
	Volumes      []Volume
	Capacities   []types.NamespacedName
}

// Volume is a PersistentVolume pinned to the node, with the claim still
// bound to it, if any.
type Volume struct {
	Name  string
	UID   types.UID
	Size  string
	Phase corev1.PersistentVolumePhase
	Claim *Claim
}

// Claim is a PersistentVolumeClaim bound to one of the node's volumes.
type Claim struct {
	types.NamespacedName
	UID types.UID
}

// Make finds what node left of driver's objects. It refuses a node whose
// Node object exists (ErrNodeExists): delete the node first, which
// `kubectl delete node` does once it is drained.
func Make(ctx context.Context, cs kubernetes.Interface, driver, node string) (*Plan, error) {
	if driver == "" || node == "" {
		return nil, errors.New("forget-node: a driver name and a node name are needed")
	}
	switch _, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); {
	case err == nil:
		return nil, fmt.Errorf("node %s: %w: drain it and delete it first (kubectl drain, kubectl delete node)", node, ErrNodeExists)
	case !apierrors.IsNotFound(err):
		return nil, fmt.Errorf("node %s: %w", node, err)
	}
	p := &Plan{Node: node, Driver: driver}
	pvs, err := cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing persistent volumes: %w", err)
	}
	for i := range pvs.Items {
		pv := &pvs.Items[i]
		if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver || !pinnedTo(pv, node) {
			continue
		}
		// Being deleted and free of the provisioner's finalizer: done
		// here; Kubernetes' own pv-protection lets go of it once the
		// volume is no longer Bound.
		if pv.DeletionTimestamp != nil && !slices.Contains(pv.Finalizers, ProvisionerFinalizer) {
			continue
		}
		v := Volume{Name: pv.Name, UID: pv.UID, Phase: pv.Status.Phase}
		if q, ok := pv.Spec.Capacity[corev1.ResourceStorage]; ok {
			v.Size = q.String()
		}
		if v.Claim, err = boundClaim(ctx, cs, pv); err != nil {
			return nil, err
		}
		p.Volumes = append(p.Volumes, v)
	}
	caps, err := cs.StorageV1().CSIStorageCapacities(metav1.NamespaceAll).List(ctx, metav1.ListOptions{LabelSelector: driverLabel + "=" + driver})
	if err != nil {
		return nil, fmt.Errorf("listing storage capacities: %w", err)
	}
	for _, c := range caps.Items {
		if c.NodeTopology != nil && c.NodeTopology.MatchLabels[topology.Key] == node {
			p.Capacities = append(p.Capacities, types.NamespacedName{Namespace: c.Namespace, Name: c.Name})
		}
	}
	return p, nil
}

// pinnedTo reports whether pv can only be on node: every term of its
// required node affinity names node's topology segment, and that alone. A
// volume that another node could serve is not the gone node's to forget.
func pinnedTo(pv *corev1.PersistentVolume, node string) bool {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil || len(pv.Spec.NodeAffinity.Required.NodeSelectorTerms) == 0 {
		return false
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		pinned := false
		for _, r := range term.MatchExpressions {
			if r.Key == topology.Key && r.Operator == corev1.NodeSelectorOpIn && slices.Equal(r.Values, []string{node}) {
				pinned = true
			}
		}
		if !pinned {
			return false
		}
	}
	return true
}

// boundClaim returns the claim pv is bound to if it still exists as that
// claim (same UID), nil if none.
func boundClaim(ctx context.Context, cs kubernetes.Interface, pv *corev1.PersistentVolume) (*Claim, error) {
	ref := pv.Spec.ClaimRef
	if ref == nil {
		return nil, nil
	}
	pvc, err := cs.CoreV1().PersistentVolumeClaims(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("claim %s/%s of %s: %w", ref.Namespace, ref.Name, pv.Name, err)
	case pvc.UID != ref.UID || pvc.Spec.VolumeName != pv.Name:
		return nil, nil // another claim of the same name since
	}
	return &Claim{NamespacedName: types.NamespacedName{Namespace: pvc.Namespace, Name: pvc.Name}, UID: pvc.UID}, nil
}

// Empty reports whether the node left nothing.
func (p *Plan) Empty() bool { return len(p.Volumes) == 0 && len(p.Capacities) == 0 }

// Print writes the plan for the operator to read.
func (p *Plan) Print(w io.Writer) {
	if p.Empty() {
		fmt.Fprintf(w, "node %s left nothing of driver %s\n", p.Node, p.Driver)
		return
	}
	fmt.Fprintf(w, "node %s is gone; of driver %s it left:\n", p.Node, p.Driver)
	for _, v := range p.Volumes {
		fmt.Fprintf(w, "  persistentvolume %s (%s, %s)", v.Name, v.Size, v.Phase)
		if v.Claim != nil {
			fmt.Fprintf(w, ", bound to claim %s", v.Claim)
		}
		fmt.Fprintln(w)
	}
	for _, c := range p.Capacities {
		fmt.Fprintf(w, "  csistoragecapacity %s\n", c)
	}
}

// Apply deletes each volume's claim, lets go of the volume (its
// provisioner's finalizer: the provisioner and the storage were on the
// node) and deletes it, then deletes the capacities. Every delete is
// conditional on the UID the plan saw, so an object made again since under
// the same name is left alone. A claim that a scheduled pod still uses
// stays until that pod goes (Kubernetes' claim protection; a pod that was
// never scheduled does not hold it); say so to the operator.
func (p *Plan) Apply(ctx context.Context, cs kubernetes.Interface, w io.Writer) error {
	var errs []error
	for _, v := range p.Volumes {
		if err := p.forgetVolume(ctx, cs, v); err != nil {
			errs = append(errs, err)
			continue
		}
		fmt.Fprintf(w, "deleted persistentvolume %s\n", v.Name)
		if v.Claim != nil {
			fmt.Fprintf(w, "deleted claim %s (a scheduled pod that still uses it keeps it until that pod is deleted)\n", v.Claim)
		}
	}
	for _, c := range p.Capacities {
		err := cs.StorageV1().CSIStorageCapacities(c.Namespace).Delete(ctx, c.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("csistoragecapacity %s: %w", c, err))
			continue
		}
		fmt.Fprintf(w, "deleted csistoragecapacity %s\n", c)
	}
	return errors.Join(errs...)
}

func (p *Plan) forgetVolume(ctx context.Context, cs kubernetes.Interface, v Volume) error {
	if c := v.Claim; c != nil {
		err := cs.CoreV1().PersistentVolumeClaims(c.Namespace).Delete(ctx, c.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &c.UID}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return fmt.Errorf("claim %s of %s: %w", c, v.Name, err)
		}
	}
	// Deleted first, then freed of the finalizer: a provisioner of another
	// node adds its finalizer back to a volume of the driver that is
	// still Bound and not being deleted (the claim's deletion takes a
	// moment to reach the volume's phase); to one being deleted it never
	// does.
	err := cs.CoreV1().PersistentVolumes().Delete(ctx, v.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &v.UID}})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("persistentvolume %s: %w", v.Name, err)
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pv, err := cs.CoreV1().PersistentVolumes().Get(ctx, v.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pv.UID != v.UID || !slices.Contains(pv.Finalizers, ProvisionerFinalizer) {
			return nil
		}
		pv.Finalizers = slices.DeleteFunc(pv.Finalizers, func(f string) bool { return f == ProvisionerFinalizer })
		_, err = cs.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("persistentvolume %s: releasing its provisioner's finalizer: %w", v.Name, err)
	}
	return nil
}
