// Package healthevents tells Kubernetes, in Events, when a volume in use on
// this node turns abnormal and when it heals. Kubelet reports a volume's
// health only in the pod's status, and only behind the alpha CSIVolumeHealth
// gate; kubernetes-csi's external-health-monitor reports it on claims but
// from a central controller that asks ListVolumes for every volume, which a
// node-local driver answers only for its own node. So the node pod does it:
// every interval it asks the plugin (NodeGetVolumeHealth, the same answer
// kubelet gets) about each volume that a pod on this node uses through a
// claim or as a CSI inline volume, and on a change it records a Warning
// VolumeConditionAbnormal (or a Normal VolumeConditionNormal, with how long
// the volume was abnormal) on the claim and on each of those pods (an
// inline volume: on its pod). A claim's status.healthStatus (Kubernetes'
// alpha CSIVolumeHealth gate; dropped by an API server without it) says
// the same: the conditions while the volume is abnormal, none once healed.
//
// What it does not see: a change that comes and goes between two probes.
package healthevents

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// Reasons of the Events, the ones kubernetes-csi's external-health-monitor
// gives, so that what watches for those finds these.
const (
	ReasonAbnormal = "VolumeConditionAbnormal"
	ReasonNormal   = "VolumeConditionNormal"
)

// Options configure a Watcher.
type Options struct {
	DriverName string // only PersistentVolumes of this CSI driver
	NodeID     string // the node whose pods are watched (spec.nodeName)
	Kube       typedcorev1.CoreV1Interface
	Node       csi.NodeClient // the plugin's Node service
	// PVCs and PVs map a pod's claim to its volume (the resizer's caches).
	PVCs corelisters.PersistentVolumeClaimLister
	PVs  corelisters.PersistentVolumeLister
	// Recorder records the Events (default: one to the API server, from
	// component mountplan on NodeID).
	Recorder record.EventRecorder
	// Interval between two probes of every volume (default 10s).
	Interval time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Watcher probes the volumes in use on its node; Run it.
type Watcher struct {
	opts     Options
	pods     corelisters.PodLister
	informer cache.SharedIndexInformer
	events   record.EventBroadcaster // nil when Options.Recorder was given
	// abnormal holds each volume (by handle) found abnormal, since when and
	// why; only Run's goroutine touches it.
	abnormal map[string]finding
}

type finding struct {
	since   time.Time
	summary string
	claim   *v1.ObjectReference // whose health status says so, if any
}

// New builds a Watcher; nothing runs before Run.
func New(opts Options) (*Watcher, error) {
	if opts.DriverName == "" || opts.NodeID == "" || opts.Kube == nil || opts.Node == nil || opts.PVCs == nil || opts.PVs == nil {
		return nil, errors.New("healthevents: driver name, node ID, both clients and both listers are required")
	}
	if opts.Interval <= 0 {
		opts.Interval = 10 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	onNode := fields.OneTermEqualSelector("spec.nodeName", opts.NodeID).String()
	informer := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = onNode
			return opts.Kube.Pods("").List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = onNode
			return opts.Kube.Pods("").Watch(ctx, o)
		},
	}, opts.Kube), &v1.Pod{}, 0, cache.Indexers{})
	w := &Watcher{opts: opts, informer: informer, pods: corelisters.NewPodLister(informer.GetIndexer()), abnormal: map[string]finding{}}
	if opts.Recorder == nil {
		w.events = record.NewBroadcaster()
		w.opts.Recorder = w.events.NewRecorder(nil, v1.EventSource{Component: "mountplan", Host: opts.NodeID})
	}
	return w, nil
}

// Run probes every interval until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	if w.events != nil {
		w.events.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: w.opts.Kube.Events("")})
		defer w.events.Shutdown()
	}
	go w.informer.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), w.informer.HasSynced) {
		return fmt.Errorf("healthevents: pods of node %s not synced: %w", w.opts.NodeID, ctx.Err())
	}
	klog.FromContext(ctx).Info("Reporting volume health in Events", "node", w.opts.NodeID, "interval", w.opts.Interval)
	t := time.NewTicker(w.opts.Interval)
	defer t.Stop()
	for {
		w.Probe(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// use is one volume in use on the node: its claim and the pods using it,
// or the one pod of an inline volume (no claim).
type use struct {
	what  string // the volume, as the Events name it
	claim *v1.ObjectReference
	// claimSaysAbnormal: the claim's status.healthStatus has conditions
	// (written by an earlier run, when the watcher starts).
	claimSaysAbnormal bool
	pods              []*v1.ObjectReference
}

// Probe asks the plugin about every volume in use on the node once and
// records an Event for each change since the last Probe.
func (w *Watcher) Probe(ctx context.Context) {
	log := klog.FromContext(ctx)
	uses, err := w.inUse()
	if err != nil {
		log.Error(err, "Listing the volumes in use on this node")
		return
	}
	for handle, u := range uses {
		conds, err := w.probe(ctx, handle)
		if err != nil {
			// Not staged here (yet), or the plugin did not answer: no
			// change can be told, so none is.
			log.V(4).Info("No health for volume", "volume", handle, "err", err)
			continue
		}
		summary := summarize(conds)
		was, found := w.abnormal[handle]
		switch {
		case summary != "" && (!found || was.summary != summary):
			if !found {
				was.since = w.opts.Now()
			}
			w.abnormal[handle] = finding{since: was.since, summary: summary, claim: u.claim}
			w.record(u, v1.EventTypeWarning, ReasonAbnormal, "%s on node %s is abnormal: %s", u.what, w.opts.NodeID, summary)
			w.setClaimHealth(ctx, u.claim, conds)
		case summary == "" && found:
			delete(w.abnormal, handle)
			w.record(u, v1.EventTypeNormal, ReasonNormal, "%s on node %s is healthy again, %v after it was found abnormal (%s)",
				u.what, w.opts.NodeID, w.opts.Now().Sub(was.since).Round(100*time.Millisecond), was.summary)
			w.setClaimHealth(ctx, u.claim, nil)
		case summary == "" && u.claimSaysAbnormal:
			w.setClaimHealth(ctx, u.claim, nil) // what an earlier run wrote
		}
	}
	// A volume no pod here uses any more: its next use starts afresh, and
	// its claim no longer says what this node found.
	for handle, was := range w.abnormal {
		if _, ok := uses[handle]; !ok {
			delete(w.abnormal, handle)
			w.setClaimHealth(ctx, was.claim, nil)
		}
	}
}

// probe returns the plugin's adverse conditions for a volume (none when
// it is healthy).
func (w *Watcher) probe(ctx context.Context, handle string) ([]*csi.VolumeHealth_VolumeHealthEntry, error) {
	ctx, cancel := context.WithTimeout(ctx, w.opts.Interval)
	defer cancel()
	resp, err := w.opts.Node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: handle})
	if err != nil {
		if status.Code(err) == codes.NotFound {
			return nil, fmt.Errorf("not on this node: %w", err)
		}
		return nil, err
	}
	return resp.GetVolumeHealth().GetHealthStatuses(), nil
}

// summarize puts a volume's adverse conditions in one line ("" when there
// are none).
func summarize(conds []*csi.VolumeHealth_VolumeHealthEntry) string {
	var parts []string
	for _, s := range conds {
		parts = append(parts, fmt.Sprintf("%s (%s): %s", s.GetStatus(), s.GetReason(), s.GetMessage()))
	}
	return strings.Join(parts, "; ")
}

// maxConditions is the API server's bound on a claim's health conditions.
const maxConditions = 16

// setClaimHealth writes claim's status.healthStatus (none for an inline
// volume's nil claim): conds, since now, or nothing (conds empty). A
// failure is logged: the Events carry the news anyway.
func (w *Watcher) setClaimHealth(ctx context.Context, claim *v1.ObjectReference, conds []*csi.VolumeHealth_VolumeHealthEntry) {
	if claim == nil {
		return
	}
	var hs *v1.VolumeHealthStatus
	if len(conds) > 0 {
		hs = &v1.VolumeHealthStatus{LastTransitionTime: metav1.NewTime(w.opts.Now())}
		for _, c := range conds[:min(len(conds), maxConditions)] {
			hs.HealthConditions = append(hs.HealthConditions, v1.VolumeHealthCondition{
				Status: statusType(c.GetStatus()), Reason: c.GetReason(), Message: c.GetMessage()})
		}
	}
	// A merge patch: null removes the field.
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"healthStatus": hs}})
	if err == nil {
		_, err = w.opts.Kube.PersistentVolumeClaims(claim.Namespace).Patch(ctx, claim.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	}
	if err != nil {
		klog.FromContext(ctx).Error(err, "Writing a claim's health status", "claim", klog.KRef(claim.Namespace, claim.Name))
	}
}

// statusType is the API's name of a CSI health error type; one it does
// not know is Degraded (something is wrong, and the volume is not said
// to be lost).
func statusType(t csi.VolumeHealthErrorType) v1.VolumeHealthStatusType {
	switch t {
	case csi.VolumeHealthErrorType_INACCESSIBLE:
		return v1.VolumeHealthInaccessible
	case csi.VolumeHealthErrorType_DATA_LOSS:
		return v1.VolumeHealthDataLoss
	default:
		return v1.VolumeHealthDegraded
	}
}

// inUse maps the handle of each of the driver's volumes that a pod on the
// node uses, through a bound claim or inline, to its claim and those pods.
func (w *Watcher) inUse() (map[string]*use, error) {
	pods, err := w.pods.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	uses := map[string]*use{}
	for _, pod := range pods {
		if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
			continue
		}
		// (References, not the objects: the lister's objects carry no
		// kind for the recorder to name.)
		ref := &v1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID}
		for _, vol := range pod.Spec.Volumes {
			if vol.CSI != nil && vol.CSI.Driver == w.opts.DriverName {
				handle := InlineHandle(string(pod.UID), vol.Name)
				uses[handle] = &use{what: fmt.Sprintf("inline volume %s (%s)", vol.Name, handle), pods: []*v1.ObjectReference{ref}}
				continue
			}
			if vol.PersistentVolumeClaim == nil {
				continue
			}
			pvc, err := w.opts.PVCs.PersistentVolumeClaims(pod.Namespace).Get(vol.PersistentVolumeClaim.ClaimName)
			if err != nil || pvc.Spec.VolumeName == "" {
				continue
			}
			pv, err := w.opts.PVs.Get(pvc.Spec.VolumeName)
			if err != nil || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != w.opts.DriverName {
				continue
			}
			handle := pv.Spec.CSI.VolumeHandle
			u := uses[handle]
			if u == nil {
				u = &use{what: "volume " + handle, claim: &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1",
					Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
					claimSaysAbnormal: pvc.Status.HealthStatus != nil && len(pvc.Status.HealthStatus.HealthConditions) > 0}
				uses[handle] = u
			}
			if !slices.ContainsFunc(u.pods, func(r *v1.ObjectReference) bool { return r.UID == ref.UID }) {
				u.pods = append(u.pods, ref)
			}
		}
	}
	return uses, nil
}

// InlineHandle is the volume ID kubelet gives a pod's CSI inline volume
// (csi-<sha256 of the pod's UID and the volume's name>, as kubelet's CSI
// plugin makes it), the ID the plugin knows the volume by.
func InlineHandle(podUID, volumeName string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(podUID+volumeName)))
}

// record records one Event on the claim (if any) and on each pod of a use.
func (w *Watcher) record(u *use, kind, reason, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if u.claim != nil {
		w.opts.Recorder.Event(u.claim, kind, reason, msg)
	}
	for _, pod := range u.pods {
		w.opts.Recorder.Event(pod, kind, reason, msg)
	}
}
