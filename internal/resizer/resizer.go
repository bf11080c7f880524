// Package resizer expands the PersistentVolumeClaims whose volumes live on
// this node. It does for a node-local driver what kubernetes-csi's
// external-resizer does for a central one (which has no node-local mode: a
// copy on each node would try every claim, and the image of a volume exists
// on one node only): when a claim asks for more than it has, it calls
// ControllerExpandVolume on the plugin of its own node, writes the new size
// into the PersistentVolume and hands the claim to kubelet
// (NodeResizePending), which grows the filesystem with NodeExpandVolume, at
// once for a volume in use or at its next mount.
//
// The claim's status follows the protocol kubelet reads
// (status.allocatedResources and allocatedResourceStatuses, conditions
// Resizing, FileSystemResizePending, ControllerResizeError).
package resizer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/watch"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
)

// Options configure a Resizer.
type Options struct {
	// DriverName: only PersistentVolumes of this CSI driver are expanded.
	DriverName string
	// TopologyKey and NodeID: only PersistentVolumes whose node affinity
	// requires TopologyKey=NodeID, i.e. that live on this node.
	TopologyKey, NodeID string
	// Kube is the API client (core/v1 only: the whole clientset would make
	// this binary four times larger); Controller the plugin's Controller service.
	Kube       typedcorev1.CoreV1Interface
	Controller csi.ControllerClient
	// Timeout bounds one ControllerExpandVolume call (default 2 minutes).
	Timeout time.Duration
	// Resync re-examines every claim this often (default 10 minutes).
	Resync time.Duration
}

// Resizer is the controller; Run it.
type Resizer struct {
	opts      Options
	pvcs      corelisters.PersistentVolumeClaimLister
	pvs       corelisters.PersistentVolumeLister
	informers []cache.SharedIndexInformer
	queue     workqueue.TypedRateLimitingInterface[string]
	recorder  record.EventRecorder
	events    record.EventBroadcaster
}

// New builds a Resizer; nothing runs before Run.
func New(opts Options) (*Resizer, error) {
	if opts.DriverName == "" || opts.TopologyKey == "" || opts.NodeID == "" || opts.Kube == nil || opts.Controller == nil {
		return nil, errors.New("resizer: driver name, topology key, node ID and both clients are required")
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 2 * time.Minute
	}
	if opts.Resync <= 0 {
		opts.Resync = 10 * time.Minute
	}
	// (ToListWatcherWithWatchListSemantics: a client that cannot stream
	// lists, the fake one of the tests, says so; the API server can.)
	pvcInformer := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return opts.Kube.PersistentVolumeClaims("").List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return opts.Kube.PersistentVolumeClaims("").Watch(ctx, o)
		},
	}, opts.Kube), &v1.PersistentVolumeClaim{}, opts.Resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	pvInformer := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return opts.Kube.PersistentVolumes().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return opts.Kube.PersistentVolumes().Watch(ctx, o)
		},
	}, opts.Kube), &v1.PersistentVolume{}, opts.Resync, cache.Indexers{})
	events := record.NewBroadcaster()
	r := &Resizer{
		opts:      opts,
		pvcs:      corelisters.NewPersistentVolumeClaimLister(pvcInformer.GetIndexer()),
		pvs:       corelisters.NewPersistentVolumeLister(pvInformer.GetIndexer()),
		informers: []cache.SharedIndexInformer{pvcInformer, pvInformer},
		queue:     workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		events:    events,
		recorder:  events.NewRecorder(nil, v1.EventSource{Component: "mountplan-resizer", Host: opts.NodeID}),
	}
	enqueue := func(obj any) {
		if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
			r.queue.Add(key)
		}
	}
	if _, err := pvcInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
	}); err != nil {
		return nil, err
	}
	// A volume bound after its claim's last update: look at the claim again.
	if _, err := pvInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if pv, ok := obj.(*v1.PersistentVolume); ok && pv.Spec.ClaimRef != nil {
				r.queue.Add(pv.Spec.ClaimRef.Namespace + "/" + pv.Spec.ClaimRef.Name)
			}
		},
	}); err != nil {
		return nil, err
	}
	return r, nil
}

// Listers are the resizer's caches of claims and volumes, filled once Run
// has started, for others in the same process to read.
func (r *Resizer) Listers() (corelisters.PersistentVolumeClaimLister, corelisters.PersistentVolumeLister) {
	return r.pvcs, r.pvs
}

// Run serves until ctx ends.
func (r *Resizer) Run(ctx context.Context, workers int) error {
	defer utilruntime.HandleCrash()
	defer r.queue.ShutDown()
	r.events.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: r.opts.Kube.Events("")})
	defer r.events.Shutdown()
	if err := r.start(ctx); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Resizer running", "driver", r.opts.DriverName, "node", r.opts.NodeID)
	for range max(workers, 1) {
		go func() {
			for r.next(ctx) {
			}
		}()
	}
	<-ctx.Done()
	return nil
}

// start runs the informers until ctx ends and waits for their caches.
func (r *Resizer) start(ctx context.Context) error {
	var synced []cache.InformerSynced
	for _, inf := range r.informers {
		go inf.RunWithContext(ctx)
		synced = append(synced, inf.HasSynced)
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return fmt.Errorf("resizer: caches not synced: %w", ctx.Err())
	}
	return nil
}

func (r *Resizer) next(ctx context.Context) bool {
	key, quit := r.queue.Get()
	if quit {
		return false
	}
	defer r.queue.Done(key)
	if err := r.Sync(ctx, key); err != nil {
		klog.FromContext(ctx).Error(err, "Expanding claim failed, will retry", "pvc", key)
		r.queue.AddRateLimited(key)
		return true
	}
	r.queue.Forget(key)
	return true
}

// Sync brings one claim (namespace/name) forward. An error means: try again later.
func (r *Resizer) Sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil // never a valid claim
	}
	pvc, err := r.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if pvc.Status.Phase != v1.ClaimBound || pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, err := r.pvs.Get(pvc.Spec.VolumeName)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !r.ours(pv) {
		return nil
	}
	want, ok := pvc.Spec.Resources.Requests[v1.ResourceStorage]
	if !ok {
		return nil
	}
	have := pvc.Status.Capacity[v1.ResourceStorage]
	if want.Cmp(have) <= 0 {
		return nil
	}
	switch st := pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage]; st {
	case v1.PersistentVolumeClaimNodeResizePending, v1.PersistentVolumeClaimNodeResizeInProgress:
		if allocated := pvc.Status.AllocatedResources[v1.ResourceStorage]; allocated.Cmp(want) >= 0 {
			return nil // kubelet's turn
		}
	case v1.PersistentVolumeClaimControllerResizeInfeasible:
		if allocated := pvc.Status.AllocatedResources[v1.ResourceStorage]; allocated.Cmp(want) == 0 {
			return nil // refused for this size; a new request tries again
		}
	}
	return r.expand(ctx, pvc, pv, want)
}

// ours says whether pv is this driver's and lives on this node.
func (r *Resizer) ours(pv *v1.PersistentVolume) bool {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != r.opts.DriverName || pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return false
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if e.Key == r.opts.TopologyKey && e.Operator == v1.NodeSelectorOpIn && len(e.Values) == 1 && e.Values[0] == r.opts.NodeID {
				return true
			}
		}
	}
	return false
}

func (r *Resizer) expand(ctx context.Context, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, want resource.Quantity) error {
	log := klog.FromContext(ctx).WithValues("pvc", klog.KObj(pvc), "pv", pv.Name, "size", want.String())
	if err := r.patchStatus(ctx, pvc, statusPatch{
		allocated: &want,
		state:     v1.PersistentVolumeClaimControllerResizeInProgress,
		condition: &v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimResizing, Status: v1.ConditionTrue},
	}); err != nil {
		return err
	}
	r.recorder.Eventf(pvc, v1.EventTypeNormal, "Resizing", "mountplan-resizer is expanding volume %s to %s", pv.Name, want.String())
	cctx, cancel := context.WithTimeout(ctx, r.opts.Timeout)
	defer cancel()
	resp, err := r.opts.Controller.ControllerExpandVolume(cctx, &csi.ControllerExpandVolumeRequest{
		VolumeId:         pv.Spec.CSI.VolumeHandle,
		CapacityRange:    &csi.CapacityRange{RequiredBytes: want.Value()},
		VolumeCapability: capability(pv),
	})
	if err != nil {
		final := isFinal(err)
		state := v1.PersistentVolumeClaimControllerResizeInProgress
		if final {
			state = v1.PersistentVolumeClaimControllerResizeInfeasible
		}
		r.recorder.Eventf(pvc, v1.EventTypeWarning, "VolumeResizeFailed", "expand volume %s: %v", pv.Name, err)
		if perr := r.patchStatus(ctx, pvc, statusPatch{allocated: &want, state: state,
			condition: &v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimControllerResizeError,
				Status: v1.ConditionTrue, Message: err.Error()}}); perr != nil {
			return perr
		}
		if final {
			log.Error(err, "Expansion refused by the plugin")
			return nil
		}
		return err
	}
	size := want
	if resp.GetCapacityBytes() > want.Value() {
		size = *resource.NewQuantity(resp.GetCapacityBytes(), resource.BinarySI)
	}
	if err := r.patchPVCapacity(ctx, pv, size); err != nil {
		return err
	}
	if resp.GetNodeExpansionRequired() {
		log.Info("Volume expanded; kubelet grows the filesystem")
		r.recorder.Eventf(pvc, v1.EventTypeNormal, "FileSystemResizeRequired", "volume %s expanded to %s; the filesystem grows on the node", pv.Name, size.String())
		return r.patchStatus(ctx, pvc, statusPatch{allocated: &want, state: v1.PersistentVolumeClaimNodeResizePending,
			condition: &v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimFileSystemResizePending, Status: v1.ConditionTrue,
				Message: "Waiting for kubelet to finish the file system resize of the volume on the node."}})
	}
	log.Info("Volume expanded")
	r.recorder.Eventf(pvc, v1.EventTypeNormal, "VolumeResizeSuccessful", "volume %s expanded to %s", pv.Name, size.String())
	return r.patchStatus(ctx, pvc, statusPatch{capacity: &size})
}

// isFinal: errors that retrying the same size cannot cure.
func isFinal(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.OutOfRange, codes.FailedPrecondition, codes.Unimplemented, codes.NotFound:
		return true
	}
	return false
}

// capability is the PersistentVolume's access as a CSI volume capability.
func capability(pv *v1.PersistentVolume) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: accessMode(pv.Spec.AccessModes)}}
	if pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == v1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
			FsType: pv.Spec.CSI.FSType, MountFlags: pv.Spec.MountOptions}}
	}
	return c
}

func accessMode(modes []v1.PersistentVolumeAccessMode) csi.VolumeCapability_AccessMode_Mode {
	if len(modes) == 0 {
		return csi.VolumeCapability_AccessMode_UNKNOWN
	}
	switch modes[0] {
	case v1.ReadWriteOncePod:
		return csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
	case v1.ReadOnlyMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	case v1.ReadWriteMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
	}
	return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
}

func (r *Resizer) patchPVCapacity(ctx context.Context, pv *v1.PersistentVolume, size resource.Quantity) error {
	if cur := pv.Spec.Capacity[v1.ResourceStorage]; cur.Cmp(size) >= 0 {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"spec": map[string]any{"capacity": map[string]any{string(v1.ResourceStorage): size.String()}}})
	if err != nil {
		return err
	}
	_, err = r.opts.Kube.PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// statusPatch is the claim status the resizer sets. Either capacity (done:
// the new size, state and resize conditions cleared) or allocated, state and
// condition (in flight). The resize conditions are the resizer's and
// kubelet's: any other condition is kept.
type statusPatch struct {
	capacity  *resource.Quantity
	allocated *resource.Quantity
	state     v1.ClaimResourceStatus
	condition *v1.PersistentVolumeClaimCondition
}

var resizeConditions = map[v1.PersistentVolumeClaimConditionType]bool{
	v1.PersistentVolumeClaimResizing:                true,
	v1.PersistentVolumeClaimFileSystemResizePending: true,
	v1.PersistentVolumeClaimControllerResizeError:   true,
	v1.PersistentVolumeClaimNodeResizeError:         true,
}

func (r *Resizer) patchStatus(ctx context.Context, pvc *v1.PersistentVolumeClaim, p statusPatch) error {
	conditions := []v1.PersistentVolumeClaimCondition{}
	for _, c := range pvc.Status.Conditions {
		if !resizeConditions[c.Type] {
			conditions = append(conditions, c)
		}
	}
	st := map[string]any{}
	storage := string(v1.ResourceStorage)
	if p.capacity != nil {
		st["capacity"] = map[string]any{storage: p.capacity.String()}
		st["allocatedResourceStatuses"] = map[string]any{storage: nil}
	} else {
		st["allocatedResources"] = map[string]any{storage: p.allocated.String()}
		st["allocatedResourceStatuses"] = map[string]any{storage: p.state}
	}
	if p.condition != nil {
		c := *p.condition
		c.LastTransitionTime = metav1.Now()
		conditions = append(conditions, c)
	}
	st["conditions"] = conditions
	patch, err := json.Marshal(map[string]any{"status": st})
	if err != nil {
		return err
	}
	_, err = r.opts.Kube.PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	return err
}
