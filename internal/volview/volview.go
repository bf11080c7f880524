// Package volview is the operator's view of what is mounted where: per
// volume, its source, device, stage and health as the plugin records them,
// and every consumer of it (a kubelet publish target on the node, or a
// container's mount namespace), each checked against the kernel's mount
// tables. The plugin builds a Report from its records (driver.Volumes)
// and serves it as JSON at /debug/volumes; `mountplan-sidecar volumes`
// fetches it, checks it again from where it runs, and prints it.
//
// It has no state and writes nothing: Check only reads /proc.
package volview

import (
	"path/filepath"
	"strings"
	"time"
)

// Report is every volume the plugin has a record of.
type Report struct {
	Node    string    `json:"node"`
	Time    time.Time `json:"time"`
	Volumes []Volume  `json:"volumes"`
	// Errors are records that did not read, and the like: the listing
	// may lack what they describe.
	Errors []string `json:"errors,omitempty"`
}

// Volume is one volume's record, as an operator reads it.
type Volume struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Kind string `json:"kind"`
	// Source says what the volume is made of (an image, an NBD export, an
	// iSCSI target, a FUSE profile), as its source kind describes it.
	Source    string `json:"source,omitempty"`
	Device    string `json:"device,omitempty"`
	DaemonPID int    `json:"daemonPID,omitempty"`
	// Stage is the stage's phase (staging, staged, unstaging), or
	// "unstaged".
	Stage       string     `json:"stage"`
	StagingPath string     `json:"stagingPath,omitempty"`
	Block       bool       `json:"block,omitempty"`
	Health      Health     `json:"health"`
	Consumers   []Consumer `json:"consumers,omitempty"`
}

// Health is what NodeGetVolumeHealth would say.
type Health struct {
	// Status is "ok", "INACCESSIBLE" or "DATA_LOSS" (CSI's error types),
	// or "-" for a volume that is not staged or whose source cannot tell.
	Status  string `json:"status"`
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
}

// Consumer kinds.
const (
	// KindPublish is a kubelet publish: a target path on the node.
	KindPublish = "publish"
	// KindNRIPublish is a kubelet publish in NRI mode: a guard stands at
	// the target on the node; the volume reaches containers only.
	KindNRIPublish = "nri-publish"
	// KindContainer is a container (or process) that received the
	// volume's plan in its own mount namespace (NRI or NodePrepare).
	KindContainer = "container"
)

// Consumer is one place the volume is mounted, as recorded.
type Consumer struct {
	Kind string `json:"kind"`
	// Path is the target path on the node (publish) or the mount point as
	// the consumer's mount namespace sees it (container).
	Path     string `json:"path"`
	ReadOnly bool   `json:"readOnly"`
	// PID, MountNS (the namespace's inode) and ContainerID are recorded
	// for a container consumer; 0 and "" when not known.
	PID         int    `json:"pid,omitempty"`
	MountNS     uint64 `json:"mountNS,omitempty"`
	ContainerID string `json:"containerID,omitempty"`
	// DeviceNode, for an NRI publish with block access, is the device
	// ("major:minor") whose node stands at Path instead of a mount: the
	// check looks for that node, not a mount.
	DeviceNode string `json:"deviceNode,omitempty"`
	// Pod is who the consumer is, as far as known: for a container, the
	// pod and container the runtime named to the NRI hook; for a publish,
	// the pod kubelet named (podInfoOnMount), or only its UID, read from
	// kubelet's target path. nil when nothing is known.
	Pod    *Pod   `json:"pod,omitempty"`
	Kernel Kernel `json:"kernel"`
}

// Pod names a pod and, for a container consumer, the container.
type Pod struct {
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	UID       string `json:"uid,omitempty"`
	Container string `json:"container,omitempty"`
}

// String is "namespace/name/container" (without "/container" for a
// publish), or "uid <uid>" when only the UID is known; "" when nothing is.
func (p *Pod) String() string {
	var s string
	switch {
	case p.Name != "":
		s = p.Namespace + "/" + p.Name
	case p.UID != "":
		s = "uid " + p.UID
	}
	if p.Container != "" {
		s += "/" + p.Container
	}
	return s
}

// PodUIDOfTarget reads the pod's UID from kubelet's target path of a
// publish: <kubeletDir>/pods/<uid>/volumes/... (mount access) or
// <kubeletDir>/plugins/kubernetes.io/csi/volumeDevices/publish/<volume>/<uid>
// (block access); "" for any other path.
func PodUIDOfTarget(kubeletDir, target string) string {
	rel, err := filepath.Rel(kubeletDir, filepath.Clean(target))
	if err != nil {
		return ""
	}
	parts := strings.Split(filepath.ToSlash(rel), "/")
	switch {
	case len(parts) >= 4 && parts[0] == "pods" && parts[2] == "volumes":
		return parts[1]
	case len(parts) == 7 && strings.Join(parts[:5], "/") == "plugins/kubernetes.io/csi/volumeDevices/publish":
		return parts[6]
	}
	return ""
}

// What the kernel says of a consumer.
const (
	// Present: the mount table of the consumer's namespace has a mount at Path.
	Present = "present"
	// Absent: it has none, where the records say there is one.
	Absent = "absent"
	// Unknown: the mount table could not be read (no process of the
	// namespace is visible from here, or reading failed); Detail says why.
	Unknown = "unknown"
	// Unchecked: nothing looked yet.
	Unchecked = ""
)

// Kernel is the outcome of checking one consumer against the kernel.
type Kernel struct {
	State string `json:"state"`
	// Disagrees says the records and the kernel differ: the records name
	// a mount the kernel does not show.
	Disagrees bool `json:"disagrees,omitempty"`
	// Via is the process whose mount table was read ("self" for the
	// node's, as this process sees it).
	Via    string `json:"via,omitempty"`
	Detail string `json:"detail,omitempty"`
}

// Disagreements counts the consumers whose records and kernel differ.
func (r *Report) Disagreements() int {
	n := 0
	for _, v := range r.Volumes {
		for _, c := range v.Consumers {
			if c.Kernel.Disagrees {
				n++
			}
		}
	}
	return n
}
