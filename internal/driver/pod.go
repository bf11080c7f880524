package driver

import (
	"strings"
	"unicode"

	"github.com/mountplan/mountplan/internal/model"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// The volume_context keys in which kubelet names the pod it publishes for
// (the CSIDriver's podInfoOnMount, which the chart sets).
const (
	ctxPodNamespace = "csi.storage.k8s.io/pod.namespace"
	ctxPodName      = "csi.storage.k8s.io/pod.name"
	ctxPodUID       = "csi.storage.k8s.io/pod.uid"
)

// maxPodField bounds each name of a pod: Kubernetes' longest (a pod's
// name, a DNS subdomain) is 253 bytes.
const maxPodField = 253

// podOfContext is the pod kubelet names in a publish's volume_context;
// the zero Pod without podInfoOnMount.
func podOfContext(vc map[string]string) (model.Pod, error) {
	p := model.Pod{Namespace: vc[ctxPodNamespace], Name: vc[ctxPodName], UID: vc[ctxPodUID]}
	return p, checkPod("volume_context csi.storage.k8s.io/pod.*", p)
}

// podOfRequest is the pod and container a NodePrepare caller names.
func podOfRequest(r *api.PodRef) (model.Pod, error) {
	p := model.Pod{Namespace: r.GetNamespace(), Name: r.GetName(), UID: r.GetUid(), Container: r.GetContainer()}
	return p, checkPod("pod", p)
}

// checkPod refuses names no Kubernetes object has: the listing shows
// them as namespace/name/container, so a slash, a space or a control
// character would make it lie, and a long one would flood it.
func checkPod(field string, p model.Pod) error {
	for _, s := range []string{p.Namespace, p.Name, p.UID, p.Container} {
		if len(s) > maxPodField {
			return invalid("%s: a name of %d bytes (at most %d)", field, len(s), maxPodField)
		}
		if i := strings.IndexFunc(s, func(r rune) bool { return r == '/' || unicode.IsSpace(r) || !unicode.IsPrint(r) }); i >= 0 {
			return invalid("%s: %q is not a Kubernetes name", field, s)
		}
	}
	return nil
}
