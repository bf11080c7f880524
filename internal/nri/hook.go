// Package nri is the mounter's NRI plugin: it gives a pod's containers their
// mountplan volumes inside their own mount namespaces, with nothing of the
// volume mounted in the host's.
//
// kubelet publishes a volume in NRI mode at its target path; the plugin's
// publish leaves a guard there instead of the volume (internal/nri/guard), or a
// device node for block access. When the runtime creates a container whose
// mounts bind such a target (or whose devices include such a device), the
// hook asks the plugin for the volume's plan on behalf of that container
// (NodePrepareVolume, the container being the consumer) and replaces the
// container's bind of the target with the plan's mounts, which the runtime
// then performs inside the container's namespace (docs/nri.md says why this
// and not the mounter entering the namespace itself).
//
// The hook keeps no state: what it claimed for a container is written in an
// annotation of that container, which the runtime hands back with every
// later event and at Synchronize after a restart. An annotation is never
// trusted alone (a pod's own annotations may reach its containers): a
// claim is honoured only for a target below the container's own pod's
// directory, or a block device the runtime gives the container, as the
// runtime's view of the container says.
package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/blocking"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Annotation is the container annotation where the hook records its claims.
const Annotation = "mountplan.csi.io/volumes"

// Claim is one container's use of one volume.
type Claim struct {
	// VolumeID is the plugin's answer; empty before the first prepare.
	VolumeID string `json:"volumeID"`
	// Target is kubelet's target path of the volume's publish (the source
	// of the container's bind), for mount access.
	Target string `json:"target,omitempty"`
	// Major and Minor are the device's number, for block access.
	Major uint32 `json:"major,omitempty"`
	Minor uint32 `json:"minor,omitempty"`
	// Destination is where the container has the volume, as it sees it: a
	// mount point, or a device path.
	Destination string `json:"destination"`
	// SubPath is the directory of the volume the container gets (a
	// subPath volume mount), empty for the whole volume.
	SubPath  string `json:"subPath,omitempty"`
	ReadOnly bool   `json:"readOnly,omitempty"`
	// AtStart: the mounter performs the plan at StartContainer, inside the
	// container's namespace, over the guard the runtime bound there (see
	// sharedReadOnly).
	AtStart bool `json:"atStart,omitempty"`
	// ContainerID, PID and Pod are not recorded: they come with each
	// event (and the annotation is never trusted to say whose it is).
	ContainerID string `json:"-"`
	PID         int    `json:"-"`
	Pod         PodRef `json:"-"`
}

// PodRef is who a container is, as the runtime says: its pod and its
// name in the pod. The plugin records it for the operator's listing.
type PodRef struct {
	Namespace, Name, UID, Container string
}

// podRef names ctr of pod.
func podRef(pod *nriapi.PodSandbox, ctr *nriapi.Container) PodRef {
	return PodRef{Namespace: pod.GetNamespace(), Name: pod.GetName(), UID: pod.GetUid(), Container: ctr.GetName()}
}

func (c Claim) block() bool { return c.Target == "" }

// Volumes is what the hook needs from the plugin (its NodePrepare service).
type Volumes interface {
	// Prepare records c's container as a consumer of the volume published
	// in NRI mode at c.Target (or of c's device) and returns the volume's
	// ID and plan. Repeating it (with the container's PID once it runs)
	// returns the same plan. NotFound: no such publish.
	Prepare(ctx context.Context, c Claim) (volumeID string, mounts []plan.Mount, err error)
	// Release forgets c. Idempotent.
	Release(ctx context.Context, c Claim) error
	// Sync releases the claims of containers other than ids.
	Sync(ctx context.Context, ids []string) error
}

// Hook handles the runtime's container events.
type Hook struct {
	volumes    Volumes
	mounter    mounter.Interface // performs the plans the runtime cannot
	stateDir   string            // where the guard lives (the plugin's state dir)
	kubeletDir string            // where targets bound to a dead guard are re-armed
	// podsDirs is kubelet's pods directory, as given and with symlinks
	// resolved (the runtime hands over resolved mount sources): only
	// binds from below it can be targets.
	podsDirs []string
	// proc is the host's /proc (the mounter runs in the host's PID
	// namespace): where a container's process is found when the runtime
	// gives no PID (pidsOf).
	proc string

	// Timeout bounds the work of CreateContainer and StartContainer: it
	// answers with an error (the container fails, kubelet retries) well
	// before the runtime's own plugin timeout, after which the runtime
	// would go on without the hook's adjustment, with the guard in place
	// of the volume, and would drop the hook's connection. Zero: three
	// quarters of the request timeout the runtime gives at registration
	// (containerd's plugin_request_timeout, 2s by default: 1.5s), so an
	// operator who raises the runtime's gives the hook the room too.
	Timeout time.Duration
	// runtimeTimeout is the runtime's request timeout, in nanoseconds,
	// as it said at the last registration; zero before.
	runtimeTimeout atomic.Int64
	// startErrorsIgnored: the runtime starts a container whatever the
	// hook answers at StartContainer (CRI-O logs the error and goes on),
	// so a container whose plan at start failed is killed before it runs
	// (StartContainer). Set at registration (Configure).
	startErrorsIgnored atomic.Bool

	// background is the work under way after its event was answered
	// (releaseLater, Synchronize's re-prepares); bg is what it runs
	// under: Run's context, so that it ends with it.
	background sync.WaitGroup
	bg         atomic.Pointer[context.Context]
	// closed: Run has ended, and no more background work starts (an
	// event the runtime still had in flight may come after).
	closedMu sync.Mutex
	closed   bool

	// Guards records the guard's mount point with the mounter, whose
	// checks of bind sources then let NRI-mode publishes bind it. NewHook
	// takes the mounter when it is one (mounter.Local, in the mounter's
	// process).
	Guards guard.Recorder
	// Plans checks every plan before the runtime gets any of it, as the
	// mounter checks the plans it performs: the runtime mounts as root
	// whatever it is handed. NewHook takes the mounter when it can
	// (mounter.Local); without, every plan is refused.
	Plans PlanChecker
	// Attributor records each container the runtime starts with a claim
	// of the hook's as one the mounter may enter: the mounter serves the
	// plugin's requests (a FUSE re-attach, a volume's stats) only in
	// namespaces it can attribute (mounter.Options.Attributed). NewHook
	// takes the mounter when it is one.
	Attributor Attributor

	mu    sync.Mutex
	guard *guard.Guard // while registered with the runtime
}

// DefaultTimeout is the hook's bound when the runtime names no timeout of
// its own: it leaves containerd's default plugin timeout (2s) room for the
// answer to travel.
const DefaultTimeout = 1500 * time.Millisecond

// releaseBudget bounds a release done after the event that asked for it
// (releaseLater), retries included: past it, the plugin's reconciler (a
// container's namespace gone) or the next Synchronize releases the claim.
const releaseBudget = time.Minute

// callTimeout bounds one call to the plugin made after its event was
// answered (a release, a re-learning): one that hangs must not hold the
// work behind it until Run ends.
const callTimeout = 10 * time.Second

// NewHook returns a hook; Run registers it with the runtime.
func NewHook(volumes Volumes, m mounter.Interface, stateDir, kubeletDir string) *Hook {
	pods := filepath.Join(kubeletDir, "pods")
	dirs := []string{pods}
	if resolved, err := filepath.EvalSymlinks(pods); err == nil && resolved != pods {
		dirs = append(dirs, resolved)
	}
	h := &Hook{volumes: volumes, mounter: m, stateDir: stateDir, kubeletDir: kubeletDir, podsDirs: dirs, proc: "/proc"}
	h.Guards, _ = m.(guard.Recorder)
	h.Plans, _ = m.(PlanChecker)
	h.Attributor, _ = m.(Attributor)
	return h
}

// Attributor records a process's mount namespace as a container's, by the
// runtime's word (mounter.Local.Attribute).
type Attributor interface {
	Attribute(ctx context.Context, pid int, by, container string) (plan.Namespace, error)
	// Forget drops what was recorded of a container that is gone.
	Forget(ctx context.Context, container string) error
}

// attribute tells the mounter that c's process is the runtime's container.
func (h *Hook) attribute(ctx context.Context, c Claim) error {
	if h.Attributor == nil || c.PID <= 0 {
		return nil
	}
	_, err := h.Attributor.Attribute(ctx, c.PID, mounter.ByRuntime, c.ContainerID)
	return err
}

// CreateContainer claims every NRI-mode volume among the container's
// mounts and block devices, and answers with the mounts and devices that
// replace them. Any failure fails the container's creation: it must never
// run without its volume.
func (h *Hook) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (_ *nriapi.ContainerAdjustment, _ []*nriapi.ContainerUpdate, err error) {
	var claims []Claim
	start := time.Now()
	ctx, cancel := h.bounded(ctx)
	defer cancel()
	defer func() {
		if err != nil {
			err = fmt.Errorf("mountplan: container %s of pod %s/%s: %w", ctr.GetName(), pod.GetNamespace(), pod.GetName(), err)
			// Not here: the failure may be this event's deadline, and the
			// runtime drops a hook that overruns its own.
			h.releaseLater(ctx, ctr.GetId(), claims)
		}
	}()
	adj := &nriapi.ContainerAdjustment{}
	for _, m := range ctr.GetMounts() {
		if m.GetType() != "bind" && !hasOption(m, "bind") && !hasOption(m, "rbind") {
			continue
		}
		target, sub, ours, err := h.owns(ctx, pod, m.GetSource())
		if err != nil {
			return nil, nil, err
		}
		if !ours {
			continue
		}
		c := Claim{Target: target, SubPath: sub, Destination: m.GetDestination(), ReadOnly: hasOption(m, "ro") || hasOption(m, "rro"), ContainerID: ctr.GetId(), Pod: podRef(pod, ctr)}
		err = h.claimMount(ctx, adj, &c, userNS(ctr))
		if c.VolumeID != "" {
			claims = append(claims, c) // prepared: released if the creation fails
		}
		if err != nil {
			return nil, nil, err
		}
		if c.AtStart && userNS(ctr) {
			adj.AddMount(placeholder(m))
		}
	}
	for _, d := range ctr.GetLinux().GetDevices() {
		if d.GetType() != "b" || hostDevice(ctx, d) {
			continue
		}
		c := Claim{Major: uint32(d.GetMajor()), Minor: uint32(d.GetMinor()), Destination: d.GetPath(), ContainerID: ctr.GetId(),
			ReadOnly: !writable(ctr, d), Pod: podRef(pod, ctr)}
		ours, err := h.claimDevice(ctx, adj, &c, d)
		if ours && c.VolumeID != "" {
			claims = append(claims, c)
		}
		if err != nil {
			return nil, nil, err
		}
	}
	if len(claims) == 0 {
		return nil, nil, nil
	}
	rec, err := json.Marshal(claims)
	if err != nil {
		return nil, nil, err
	}
	adj.AddAnnotation(Annotation, string(rec))
	klog.FromContext(ctx).V(2).Info("Container gets its volumes through the runtime", "container", ctr.GetId(),
		"pod", klog.KRef(pod.GetNamespace(), pod.GetName()), "volumes", len(claims), "took", time.Since(start))
	return adj, nil, nil
}

// owns says whether a container bind's source is a target published in NRI
// mode for the container's own pod (below its pod's directory, bound to
// the live guard), or a subPath of one: kubelet's bind, under the pod's
// volume-subpaths, of a directory below the target, which the guard names
// after the target (guard.At). It returns the target and the subPath. A
// bind of another pod's target (a hostPath volume naming it) is not
// claimed: the container gets what the runtime binds, the guard, never
// the other pod's volume.
//
// Whatever the source's filesystem does, owns returns by ctx's end: the
// runtime drops a plugin that overruns its deadline, for the whole node.
// A source that is not below the pod's directory is decided by its name
// alone; one below it (the pod's other volumes, a classic sshfs volume
// among them) is stat'ed (guard.Locate), and one whose filesystem does
// not answer fails the container (ErrUnavailable).
func (h *Hook) owns(ctx context.Context, pod *nriapi.PodSandbox, source string) (target, sub string, ours bool, err error) {
	podDir, ok := h.podDirOf(pod, source)
	if !ok {
		return "", "", false, nil
	}
	h.mu.Lock()
	g := h.guard
	h.mu.Unlock()
	if g == nil {
		// Not registered (yet): whatever binds a guard must fail, and will,
		// since no guard answers.
		return "", "", false, nil
	}
	name, sub, ours, err := g.Locate(ctx, source)
	if err != nil || !ours || sub == "" {
		return source, "", ours, err
	}
	target = guard.TargetIn(podDir, name)
	if tname, tsub, tours, err := g.Locate(ctx, target); err != nil || !tours || tname != name || tsub != "" {
		return "", "", false, fmt.Errorf("%s is subPath %s of a volume named %s, which is not published in NRI mode at %s: %w",
			source, sub, name, target, errors.Join(err, errdefs.ErrFailedPrecondition))
	}
	return target, sub, true, nil
}

// claimMount prepares the volume at c.Target and replaces the container's
// bind of it with the plan's mounts, once the mounter has checked them.
// A container with a user namespace of its own (idmapped) gets them from the
// mounter at its start instead, idmapped to that namespace (see
// userNS).
func (h *Hook) claimMount(ctx context.Context, adj *nriapi.ContainerAdjustment, c *Claim, idmapped bool) error {
	id, mounts, err := h.prepare(ctx, *c)
	if err != nil {
		return fmt.Errorf("volume at %s: %w", c.Destination, err)
	}
	c.VolumeID = id
	// Before anything else looks at the plan: sharedReadOnly opens its
	// devices, ociMounts hands it to the runtime.
	p, err := h.checked(ctx, mounts)
	if err != nil {
		return fmt.Errorf("volume %s at %s: %w", id, c.Destination, err)
	}
	if c.SubPath != "" {
		// The runtime cannot mount a directory of a filesystem: it binds
		// what kubelet bound (the guard's twin of the subPath), and
		// StartContainer mounts the volume's own directory over it.
		c.AtStart = true
		return nil
	}
	if sharedReadOnly(p) || idmapped {
		c.AtStart = true // the runtime binds the guard; StartContainer mounts over it
		return nil
	}
	oci, err := ociMounts(c.Destination, p)
	if err != nil {
		return fmt.Errorf("volume %s at %s: %w", id, c.Destination, err)
	}
	for _, m := range oci {
		adj.AddMount(m)
	}
	return nil
}

// claimDevice prepares the volume published in NRI mode with the
// container's device d, if there is one. The container keeps the device
// the runtime gives it (kubelet's device node of the volume, with the
// access kubelet asked for): the plan's device must be that very device.
// A volume read-only to the container (kubelet's device rule without "w",
// or a plan that binds the device ro) gets a rule that denies writes.
//
// Unlike a mount, a block volume does not depend on the hook: the runtime
// gives the container the device of kubelet's device node anyway. So when
// the plugin cannot be asked (the plugin's own container being created,
// with the host's devices) the device is left as it is and only its
// consumer record is missing.
//
// The plan is not checked as a mount plan is (checked): nothing of it
// reaches the runtime, and its device, only stat'ed, must be the very one
// the runtime gives the container; all a plan can do is deny writes.
func (h *Hook) claimDevice(ctx context.Context, adj *nriapi.ContainerAdjustment, c *Claim, d *nriapi.LinuxDevice) (bool, error) {
	id, mounts, err := h.prepare(ctx, *c)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, nil // a device that is not one of our volumes
	}
	if err != nil {
		klog.FromContext(ctx).Error(err, "Cannot tell whether a container's block device is a volume; leaving it as the runtime has it",
			"container", c.ContainerID, "device", c.Destination, "major", c.Major, "minor", c.Minor)
		return false, nil
	}
	c.VolumeID = id
	dev, ro, err := deviceOf(ctx, mounts)
	if err != nil {
		return true, fmt.Errorf("block volume %s at %s: %w", id, c.Destination, err)
	}
	if dev.GetMajor() != d.GetMajor() || dev.GetMinor() != d.GetMinor() {
		return true, fmt.Errorf("block volume %s at %s: the plan's device %d:%d is not the container's %d:%d: %w",
			id, c.Destination, dev.GetMajor(), dev.GetMinor(), d.GetMajor(), d.GetMinor(), errdefs.ErrFailedPrecondition)
	}
	c.ReadOnly = c.ReadOnly || ro
	if c.ReadOnly {
		denyWrites(adj, dev)
	}
	return true, nil
}

// writable reports whether the runtime lets the container write device d:
// the last of its device cgroup rules that names d (or all block devices)
// and "w" allows it.
func writable(ctr *nriapi.Container, d *nriapi.LinuxDevice) bool {
	w := false
	for _, r := range ctr.GetLinux().GetResources().GetDevices() {
		if (r.GetType() != "b" && r.GetType() != "a") || !strings.Contains(r.GetAccess(), "w") {
			continue
		}
		if (r.GetMajor() == nil || r.GetMajor().GetValue() == d.GetMajor()) && (r.GetMinor() == nil || r.GetMinor().GetValue() == d.GetMinor()) {
			w = r.GetAllow()
		}
	}
	return w
}

// denyWrites adds a device cgroup rule that takes "w" away from dev: it
// comes after the runtime's own rules, so it wins.
func denyWrites(adj *nriapi.ContainerAdjustment, dev *nriapi.LinuxDevice) {
	if adj.Linux == nil {
		adj.Linux = &nriapi.LinuxContainerAdjustment{}
	}
	if adj.Linux.Resources == nil {
		adj.Linux.Resources = &nriapi.LinuxResources{}
	}
	adj.Linux.Resources.Devices = append(adj.Linux.Resources.Devices, &nriapi.LinuxDeviceCgroup{
		Allow: false, Type: "b", Major: nriapi.Int64(dev.GetMajor()), Minor: nriapi.Int64(dev.GetMinor()), Access: "w"})
}

// hostDevice reports whether a container's device is a device of the
// host at the same path (a privileged container has them all): not a
// block volume, which kubelet places at the path the pod asks for. Telling
// them apart here spares the plugin a question per host device. The host's
// devices are below /dev: a path elsewhere (a pod's, which may lead
// through a filesystem that never answers) is not stat'ed, and a stat
// that has not answered by ctx's end says no (the plugin is asked).
func hostDevice(ctx context.Context, d *nriapi.LinuxDevice) bool {
	p := d.GetPath()
	if p != filepath.Clean(p) || !strings.HasPrefix(p, "/dev/") {
		return false
	}
	st, err := blocking.Stat(ctx, p)
	return err == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK &&
		unix.Major(uint64(st.Rdev)) == uint32(d.GetMajor()) && unix.Minor(uint64(st.Rdev)) == uint32(d.GetMinor()) //nolint:unconvert // Rdev is uint32 on some architectures
}

// deviceOf returns the device a block plan (a bind of a device node)
// names, and whether it binds it read-only. The device is stat'ed by
// ctx's end, and only at a clean path below /dev: a plan naming
// /dev/../elsewhere (a compromised plugin's, maybe onto a filesystem that
// never answers) is refused before any stat.
func deviceOf(ctx context.Context, mounts []plan.Mount) (*nriapi.LinuxDevice, bool, error) {
	for _, m := range mounts {
		if !m.IsDeviceBind() {
			continue
		}
		if m.Source != filepath.Clean(m.Source) {
			return nil, false, fmt.Errorf("the plan's device %s is not a clean path: %w", m.Source, errdefs.ErrInvalidArgument)
		}
		st, err := blocking.Stat(ctx, m.Source)
		if err != nil {
			return nil, false, err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFBLK {
			return nil, false, fmt.Errorf("%s is not a block device", m.Source)
		}
		dev := &nriapi.LinuxDevice{Type: "b", Major: int64(unix.Major(uint64(st.Rdev))), Minor: int64(unix.Minor(uint64(st.Rdev)))} //nolint:unconvert // Rdev is uint32 on some architectures
		return dev, m.HasOption("ro"), nil
	}
	return nil, false, errors.New("the plan binds no device")
}

// StartContainer comes once the container's process exists and before it
// runs: the plugin records the container's namespace with its claims, so
// that it can tell when the container is gone, and the mounter performs
// the plans the runtime could not (AtStart). The other volumes are already
// in place: a failure to record only delays that record until the next
// Synchronize, and does not stop the container.
func (h *Hook) StartContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	start := time.Now()
	ctx, cancel := h.bounded(ctx)
	defer cancel()
	claims := h.claimsOf(ctx, pod, ctr)
	if len(claims) == 0 {
		return nil
	}
	pid, pidErr := pidOf(h.proc, ctr)
	defer func() {
		klog.FromContext(ctx).V(4).Info("Container starts", "container", ctr.GetId(), "pid", pid, "took", time.Since(start))
	}()
	// Named to the mounter once, whatever the number of its claims.
	var attrErr error
	if pidErr == nil {
		if attrErr = h.attribute(ctx, Claim{PID: pid, ContainerID: ctr.GetId()}); attrErr != nil {
			klog.FromContext(ctx).Error(attrErr, "Naming a started container to the mounter", "container", ctr.GetId())
		}
	}
	for _, c := range claims {
		if pidErr != nil {
			if c.AtStart {
				return fmt.Errorf("mountplan: volume %s at %s of container %s: %w", c.VolumeID, c.Destination, ctr.GetName(), pidErr)
			}
			klog.FromContext(ctx).Error(pidErr, "Recording a started container's namespace", "container", ctr.GetId(), "volume", c.VolumeID)
			continue
		}
		c.PID = pid
		if attrErr != nil && c.AtStart {
			err := fmt.Errorf("mountplan: volume %s at %s of container %s: %w", c.VolumeID, c.Destination, ctr.GetName(), attrErr)
			h.neverRun(ctx, ctr, pid, err)
			return err
		}
		_, mounts, err := h.prepare(ctx, c)
		if !c.AtStart {
			if err != nil {
				klog.FromContext(ctx).Error(err, "Recording a started container's namespace", "container", ctr.GetId(), "volume", c.VolumeID)
			}
			continue
		}
		if err == nil {
			err = h.mounter.Mount(ctx, mounts, plan.Consumer{PID: c.PID, MountPoint: c.Destination, SubPath: c.SubPath})
		}
		if err != nil {
			err = fmt.Errorf("mountplan: volume %s at %s of container %s: %w", c.VolumeID, c.Destination, ctr.GetName(), err)
			h.neverRun(ctx, ctr, pid, err)
			return err
		}
	}
	return nil
}

// neverRun kills a container whose start the hook refuses, when the
// runtime would start it anyway (startErrorsIgnored): its process has not
// run the container's program yet (it waits for the runtime's start), so
// the start fails and kubelet retries, as with a runtime that heeds the
// hook. Without it the program would run with the guard where its volume
// belongs.
func (h *Hook) neverRun(ctx context.Context, ctr *nriapi.Container, pid int, why error) {
	if !h.startErrorsIgnored.Load() || pid <= 0 {
		return
	}
	err := unix.Kill(pid, unix.SIGKILL)
	klog.FromContext(ctx).Error(why, "Killed the container before it ran: the runtime starts it whatever the hook answers",
		"container", ctr.GetId(), "pid", pid, "killError", err)
}

// StopContainer releases the container's claims: its namespace, and the
// volume's mounts in it, are gone or about to be. The runtime does not
// wait for it (releaseLater).
func (h *Hook) StopContainer(ctx context.Context, _ *nriapi.PodSandbox, ctr *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	h.releaseLater(ctx, ctr.GetId(), recordedClaims(ctr))
	return nil, nil
}

// RemoveContainer releases what StopContainer did not: a container created
// and removed without running, a creation the runtime undid.
func (h *Hook) RemoveContainer(ctx context.Context, _ *nriapi.PodSandbox, ctr *nriapi.Container) error {
	h.releaseLater(ctx, ctr.GetId(), recordedClaims(ctr))
	return nil
}

// releaseLater releases a container's claims after the event that asked
// for it has been answered. A release changes nothing the runtime waits
// for, and it holds the runtime's serialized section while it runs: under
// load (a node starting and stopping dozens of pods at once) a release
// waiting on a busy volume's lock overran the runtime's plugin timeout,
// and the runtime then dropped the hook, failing every container it was
// about to create with the guard in place of its volume. A volume busy
// with other work (Aborted) or a plugin that does not answer is asked
// again, for about 13 s (periodic.Retry's doubling pauses up to 10 s),
// within releaseBudget.
func (h *Hook) releaseLater(ctx context.Context, containerID string, claims []Claim) {
	if !slices.ContainsFunc(claims, func(c Claim) bool { return c.VolumeID != "" }) {
		return
	}
	h.later(ctx, func(bg context.Context) {
		ctx, cancel := context.WithTimeout(bg, releaseBudget)
		defer cancel()
		for _, c := range claims {
			if c.VolumeID == "" {
				continue
			}
			c.ContainerID = containerID
			err := askAgain(ctx, 100*time.Millisecond, 10*time.Second, transient, func(ctx context.Context) error {
				ctx, cancel := context.WithTimeout(ctx, callTimeout)
				defer cancel()
				return h.volumes.Release(ctx, c)
			})
			if err != nil {
				klog.FromContext(ctx).Error(err, "Releasing a container's claim; the plugin's reconciler or the hook's next registration will",
					"container", containerID, "volume", c.VolumeID)
			}
		}
		if h.Attributor != nil {
			if err := h.Attributor.Forget(ctx, containerID); err != nil {
				klog.FromContext(ctx).Error(err, "Forgetting a container's namespace; the mounter's next prune will", "container", containerID)
			}
		}
	})
}

// later runs fn after the event of ctx has been answered, under Run's
// context (ctx's logger kept), or ctx's values alone outside Run.
func (h *Hook) later(ctx context.Context, fn func(context.Context)) {
	bg := context.WithoutCancel(ctx)
	if p := h.bg.Load(); p != nil {
		bg = klog.NewContext(*p, klog.FromContext(ctx))
	}
	h.closedMu.Lock()
	defer h.closedMu.Unlock()
	if h.closed {
		return
	}
	h.background.Add(1)
	go func() {
		defer h.background.Done()
		fn(bg)
	}()
}

// close waits for the background work and starts no more.
func (h *Hook) close() {
	h.closedMu.Lock()
	h.closed = true
	h.closedMu.Unlock()
	h.background.Wait()
}

// transient: an answer another try may change (a volume busy with other
// work, a plugin that does not answer).
func transient(err error) bool {
	return errors.Is(err, errdefs.ErrAborted) || errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded)
}

// wait waits for the work under way after its event (later); tests.
func (h *Hook) wait() { h.background.Wait() }

// claimsOf reads the hook's annotation of a container and keeps only
// what the runtime's view of the container backs: targets below its own
// pod's directory, block devices the runtime gives it. What the
// annotation says beyond that (another pod's volume: a forged annotation
// reaches a container where the runtime passes pod annotations through)
// is dropped, and logged.
func (h *Hook) claimsOf(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) []Claim {
	claims := recordedClaims(ctr)
	kept := claims[:0]
	for _, c := range claims {
		if c.block() && hasDevice(ctr, c) || !c.block() && h.ofPod(pod, c.Target) {
			c.Pod = podRef(pod, ctr)
			kept = append(kept, c)
			continue
		}
		klog.FromContext(ctx).Info("Ignoring a claim of the container's annotation that its pod does not back",
			"container", ctr.GetId(), "pod", klog.KRef(pod.GetNamespace(), pod.GetName()), "target", c.Target, "major", c.Major, "minor", c.Minor)
	}
	return kept
}

// recordedClaims reads the hook's annotation of a container, as it is: a
// release (of that container's own claims, by its ID) needs no more.
func recordedClaims(ctr *nriapi.Container) []Claim {
	rec, ok := ctr.GetAnnotations()[Annotation]
	if !ok {
		return nil
	}
	var claims []Claim
	if err := json.Unmarshal([]byte(rec), &claims); err != nil {
		return nil
	}
	for i := range claims {
		claims[i].ContainerID = ctr.GetId()
	}
	return claims
}

// ofPod reports whether p lies below pod's own directory in kubelet's
// pods directory (the runtime gives the pod's UID).
func (h *Hook) ofPod(pod *nriapi.PodSandbox, p string) bool {
	_, ok := h.podDirOf(pod, p)
	return ok
}

// podDirOf returns pod's own directory in kubelet's pods directory, as
// p names it (given or resolved), if p lies below it.
func (h *Hook) podDirOf(pod *nriapi.PodSandbox, p string) (string, bool) {
	uid := pod.GetUid()
	if uid == "" || strings.ContainsAny(uid, "/\x00") || uid == "." || uid == ".." {
		return "", false
	}
	for _, d := range h.podsDirs {
		if dir := filepath.Join(d, uid); plan.Within(dir, p) {
			return dir, true
		}
	}
	return "", false
}

// hasDevice reports whether the runtime gives the container c's device at
// c's destination.
func hasDevice(ctr *nriapi.Container, c Claim) bool {
	return slices.ContainsFunc(ctr.GetLinux().GetDevices(), func(d *nriapi.LinuxDevice) bool {
		return d.GetType() == "b" && d.GetPath() == c.Destination && d.GetMajor() == int64(c.Major) && d.GetMinor() == int64(c.Minor)
	})
}

// bounded gives a container event's work its deadline (timeout).
func (h *Hook) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, h.timeout())
}

// timeout is Timeout, or when zero three quarters of the runtime's
// request timeout (DefaultTimeout until the runtime has said).
func (h *Hook) timeout() time.Duration {
	if h.Timeout > 0 {
		return h.Timeout
	}
	if rt := time.Duration(h.runtimeTimeout.Load()); rt > 0 {
		return rt * 3 / 4
	}
	return DefaultTimeout
}

// runtimeSays records the request timeout the runtime gave at
// registration.
func (h *Hook) runtimeSays(requestTimeout time.Duration) {
	h.runtimeTimeout.Store(int64(requestTimeout))
}

// Configure learns which runtime the hook serves: CRI-O does not fail a
// container's start on a plugin's error (startErrorsIgnored). The events
// the hook takes are the ones it implements (no mask).
func (h *Hook) Configure(ctx context.Context, _, runtime, version string) (nriapi.EventMask, error) {
	h.startErrorsIgnored.Store(runtime == "cri-o")
	klog.FromContext(ctx).V(2).Info("Runtime", "name", runtime, "version", version)
	return 0, nil
}

// Synchronize runs when the hook (re)registers: the guard starts (targets
// left bound to a dead one are re-armed), the plugin forgets the claims of
// containers that are gone and re-learns those of every running container
// with its namespace. The runtime creates no container until Synchronize
// returns, and drops the hook when it takes longer than its request
// timeout, so only the guard and the forgetting happen before the answer;
// a forgetting that overruns the hook's bound fails the registration (the
// plugin may still be at it with this list). The re-learning, a call per
// claim that may wait on a busy volume, goes on after the answer, several
// at a time. A container that stops meanwhile is released after its claim
// was re-learned, or its claim is not re-learned (the plugin cannot name a
// dead process's namespace), or it names a namespace that is gone, which
// the plugin's reconciler drops. A container not started is not
// re-learned: it tells its claims, with its namespace, at StartContainer.
func (h *Hook) Synchronize(ctx context.Context, pods []*nriapi.PodSandbox, ctrs []*nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	if err := h.startGuard(ctx); err != nil {
		return nil, err
	}
	podOf := map[string]*nriapi.PodSandbox{}
	for _, p := range pods {
		podOf[p.GetId()] = p
	}
	ids := make([]string, 0, len(ctrs))
	var claims []Claim
	pids, err := pidsOf(h.proc, runningClaimants(ctrs))
	if err != nil {
		// Not fatal: the containers without a PID are not re-learned
		// (their claims stay as the plugin recorded them).
		klog.FromContext(ctx).Error(err, "Finding the processes of containers the runtime gave no PID")
	}
	for _, ctr := range ctrs {
		ids = append(ids, ctr.GetId())
		pid := pids[ctr.GetId()]
		if ctr.GetState() != nriapi.ContainerState_CONTAINER_RUNNING || pid == 0 {
			// Not re-learned: a container that has not started tells the
			// plugin its claims, with its namespace, at StartContainer;
			// re-learned without one after its removal's release, a claim
			// would hold the volume until the next registration.
			continue
		}
		for _, c := range h.claimsOf(ctx, podOf[ctr.GetPodSandboxId()], ctr) {
			c.PID = pid
			claims = append(claims, c)
		}
	}
	bounded, cancel := h.bounded(ctx)
	defer cancel()
	if err := h.volumes.Sync(bounded, ids); bounded.Err() != nil {
		// The plugin may still be at it, with this list: a container
		// created once this returns would lose its claim to it. Failing
		// the registration keeps the runtime from creating any (it drops
		// the hook, which registers again after a pause).
		return nil, fmt.Errorf("having the plugin forget the claims of containers that are gone: %w", errors.Join(err, bounded.Err()))
	} else if err != nil {
		// Not fatal (a volume busy with other work): the next
		// registration forgets them.
		klog.FromContext(ctx).Error(err, "Having the plugin forget the claims of containers that are gone")
	}
	klog.FromContext(ctx).Info("Synchronized with the runtime", "pods", len(pods), "containers", len(ctrs), "claims", len(claims))
	if len(claims) > 0 {
		h.later(ctx, func(ctx context.Context) { h.relearn(ctx, claims) })
	}
	return nil, nil
}

// runningClaimants are the running containers with a claim of the hook's:
// the ones whose process Synchronize needs.
func runningClaimants(ctrs []*nriapi.Container) []*nriapi.Container {
	var out []*nriapi.Container
	for _, ctr := range ctrs {
		if _, ok := ctr.GetAnnotations()[Annotation]; ok && ctr.GetState() == nriapi.ContainerState_CONTAINER_RUNNING {
			out = append(out, ctr)
		}
	}
	return out
}

// relearn has the plugin re-learn claims, syncWorkers at a time.
func (h *Hook) relearn(ctx context.Context, claims []Claim) {
	var g errgroup.Group
	g.SetLimit(syncWorkers)
	var mu sync.Mutex
	var errs []error
	for _, c := range claims {
		g.Go(func() error {
			ctx, cancel := context.WithTimeout(ctx, callTimeout)
			defer cancel()
			if err := h.prepareAgain(ctx, c); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				mu.Lock()
				errs = append(errs, fmt.Errorf("container %s, volume %s: %w", c.ContainerID, c.VolumeID, err))
				mu.Unlock()
			}
			return nil
		})
	}
	_ = g.Wait()
	if err := errors.Join(errs...); err != nil {
		// Not fatal: the claims that were restored are; the rest are
		// retried at the next registration.
		klog.FromContext(ctx).Error(err, "Re-learning container claims")
	}
	klog.FromContext(ctx).V(2).Info("Re-learned container claims", "claims", len(claims), "failed", len(errs))
}

// syncWorkers is how many claims relearn asks about at once: the plugin
// serves calls concurrently (one lock per volume).
const syncWorkers = 8

// prepareAgain has the plugin re-learn a running container's claim. A
// volume busy with other work (Aborted: the plugin's reconcile, which a
// restarted mounter sets off at the same moment as this registration)
// is asked again, for a few seconds: nothing else would tell the plugin
// this container's namespace.
func (h *Hook) prepareAgain(ctx context.Context, c Claim) error {
	return askAgain(ctx, 10*time.Millisecond, 2*time.Second, busy,
		func(ctx context.Context) error {
			// A restarted mounter learns the running containers again here.
			if err := h.attribute(ctx, c); err != nil {
				return err
			}
			_, _, err := h.volumes.Prepare(ctx, c)
			return err
		})
}

// prepare asks the plugin for a claim's plan, and again while the volume
// is busy with other work (Aborted: the plugin's reconcile holds its lock
// for a moment), until ctx's end: the hook's own deadline, short of the
// runtime's. A container is not failed for a lock held by a background
// pass; kubelet would retry it, but only after its back-off.
func (h *Hook) prepare(ctx context.Context, c Claim) (id string, mounts []plan.Mount, err error) {
	err = askAgain(ctx, 10*time.Millisecond, 500*time.Millisecond, busy,
		func(ctx context.Context) (err error) {
			id, mounts, err = h.volumes.Prepare(ctx, c)
			return err
		})
	return id, mounts, err
}

// busy: the plugin's answer for a volume whose lock other work holds for
// a moment (Aborted), which another try may change.
func busy(err error) bool { return errors.Is(err, errdefs.ErrAborted) }

// askAgain calls call, and again while its answer is one another try may
// change (again), first after first and then twice as long each time up
// to limit (periodic.Retry). It returns the last answer.
func askAgain(ctx context.Context, first, limit time.Duration, again func(error) bool, call func(context.Context) error) error {
	err := call(ctx)
	if !again(err) {
		return err
	}
	periodic.Retry(ctx, first, limit, func(ctx context.Context) error {
		if err = call(ctx); again(err) {
			return err
		}
		return nil // done, or an answer another try would not change
	})
	return err
}

// startGuard starts the guard (once per registration) and re-arms the
// targets a dead guard left.
func (h *Hook) startGuard(ctx context.Context) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.guard == nil {
		g, err := guard.Start(h.stateDir, h.Guards)
		if err != nil {
			return fmt.Errorf("starting the guard: %w", err)
		}
		h.guard = g
	}
	n, err := h.guard.Rearm(h.kubeletDir)
	if n > 0 {
		klog.FromContext(ctx).Info("Re-armed targets left bound to a dead guard", "targets", n)
	}
	return err
}

// stopGuard stops the guard: from now on no container can bind a target
// published in NRI mode, until the hook registers again.
func (h *Hook) stopGuard(ctx context.Context) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.guard == nil {
		return
	}
	if err := h.guard.Stop(); err != nil {
		klog.FromContext(ctx).Error(err, "Stopping the guard")
	}
	h.guard = nil
}

func hasOption(m *nriapi.Mount, opt string) bool { return slices.Contains(m.GetOptions(), opt) }

// userNS reports whether the container has a user namespace of its own (a
// pod with hostUsers: false): its root is an unprivileged uid of the node,
// and a volume mounted as it is shows that root its files owned by nobody.
// Runtimes idmap only binds (runc refuses "idmap" on any other mount), and
// a plan mounts filesystems, so such a container's plans are performed by
// the mounter at StartContainer, which idmaps every mount it makes in a
// namespace owned by another user namespace (the mounter decides it from the
// namespace, not from any option of the plugin's plan).
func userNS(ctr *nriapi.Container) bool {
	for _, ns := range ctr.GetLinux().GetNamespaces() {
		if ns.GetType() == "user" {
			return true
		}
	}
	return false
}

// placeholder replaces the runtime's bind m (of the guard, or of its
// subPath twin) in a container with a user namespace, until the mounter
// mounts the plan over it at the container's start: runc, by then root of
// the container's user namespace and so an unprivileged uid of the node,
// cannot even stat the guard (a FUSE filesystem, which answers no other
// uid: "create mountpoint for /data mount: stat ...: permission denied"),
// nor idmap it. An empty read-only tmpfs, which a user namespace may mount,
// holds the place; it never holds data. The runtime's uid/gid mappings of
// m, which NRI does not show, go with it (an adjustment's mount replaces the
// one at its destination).
func placeholder(m *nriapi.Mount) *nriapi.Mount {
	return &nriapi.Mount{Destination: m.GetDestination(), Type: "tmpfs", Source: "mountplan-placeholder",
		Options: []string{"ro", "nosuid", "nodev", "noexec", "size=4k", "mode=0555"}}
}
