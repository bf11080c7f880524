// Package nri is the mounter's NRI plugin: it gives a pod's containers their
// mountplan volumes inside their own mount namespaces, with nothing of the
// volume mounted in the host's.
//
// kubelet publishes a volume in NRI mode at its target path; the plugin's
// publish leaves there a guard instead of the volume (see Guard). When the
// runtime creates a container whose mounts name such a target, the hook
// asks the plugin for the volume's plan on behalf of that container
// (NodePrepareVolume, the container being the consumer) and replaces the
// container's bind of the target with the plan's mounts, which the runtime
// then performs inside the container's namespace (see docs/nri.md for why
// this, and not the mounter entering the namespace itself).
package nri

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	nriapi "github.com/containerd/nri/pkg/api"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Claim is one container's use of one volume.
type Claim struct {
	// Target is kubelet's target path of the volume's publish: the source
	// of the container's bind mount.
	Target string
	// ContainerID is the runtime's ID of the container.
	ContainerID string
	// Destination is where the container mounts the volume, as it sees it.
	Destination string
	// ReadOnly is set when the container mounts it read-only.
	ReadOnly bool
	// PID is the container's process once it exists (StartContainer); 0
	// before.
	PID int
}

// Prepared is the plugin's answer to a claim.
type Prepared struct {
	VolumeID string
	Mounts   []plan.Mount
}

// Volumes is what the hook needs from the plugin.
type Volumes interface {
	// Prepare records c as a consumer of the volume published at c.Target
	// and returns its plan. Repeating it for the same container and
	// destination (now with its PID) returns the same plan.
	Prepare(ctx context.Context, c Claim) (Prepared, error)
	// Release forgets the claim. Idempotent.
	Release(ctx context.Context, volumeID string, c Claim) error
}

// Mode is how a container receives a volume's plan.
type Mode int

const (
	// ModeAdjust turns the plan into the container's OCI mounts at
	// CreateContainer: the runtime performs them inside the container's
	// namespace.
	ModeAdjust Mode = iota
	// ModeMount (a prototype kept for the measurement in docs/nri.md)
	// replaces the target's bind by an empty read-only placeholder at
	// CreateContainer and has the mounter perform the plan over it, inside
	// the container's namespace, at StartContainer: after the namespace
	// exists and before the container's process runs.
	ModeMount
)

// Hook handles the runtime's container events.
type Hook struct {
	volumes Volumes
	mode    Mode
	mounter mounter.Interface // ModeMount only
	// isTarget says whether a container mount binds a target published in
	// NRI mode.
	isTarget func(m *nriapi.Mount) bool

	mu     sync.Mutex
	claims map[string][]held // by container ID
}

// held is a claim the plugin accepted.
type held struct {
	Claim
	volumeID string
	mounts   []plan.Mount
}

// Options configure a Hook.
type Options struct {
	Volumes  Volumes
	Mode     Mode
	Mounter  mounter.Interface
	IsTarget func(m *nriapi.Mount) bool
}

// NewHook returns a hook; it does nothing until a Stub runs it.
func NewHook(o Options) *Hook {
	return &Hook{volumes: o.Volumes, mode: o.Mode, mounter: o.Mounter, isTarget: o.IsTarget, claims: map[string][]held{}}
}

// CreateContainer claims every NRI-mode volume among the container's mounts
// and answers with the mounts that replace the target's bind. Any failure
// fails the container's creation: it must never start without its volume.
func (h *Hook) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (_ *nriapi.ContainerAdjustment, _ []*nriapi.ContainerUpdate, err error) {
	var claims []held
	defer func() {
		if err != nil {
			h.release(ctx, claims)
		}
	}()
	adj := &nriapi.ContainerAdjustment{}
	for _, m := range ctr.GetMounts() {
		if !h.isTarget(m) {
			continue
		}
		c := Claim{Target: m.Source, ContainerID: ctr.GetId(), Destination: m.Destination, ReadOnly: readOnly(m)}
		mounts, err := h.adjust(ctx, adj, c)
		if err != nil {
			return nil, nil, fmt.Errorf("mountplan: volume at %s of container %s in pod %s/%s: %w",
				m.Destination, ctr.GetName(), pod.GetNamespace(), pod.GetName(), err)
		}
		claims = append(claims, mounts)
	}
	if len(claims) == 0 {
		return nil, nil, nil
	}
	h.mu.Lock()
	h.claims[ctr.GetId()] = append(h.claims[ctr.GetId()], claims...)
	h.mu.Unlock()
	klog.FromContext(ctx).V(2).Info("Container gets its volumes from the runtime", "container", ctr.GetId(), "pod", klog.KRef(pod.GetNamespace(), pod.GetName()), "volumes", len(claims))
	return adj, nil, nil
}

// adjust claims one volume for the container and adds to adj what the
// runtime must mount in its place.
func (h *Hook) adjust(ctx context.Context, adj *nriapi.ContainerAdjustment, c Claim) (held, error) {
	if h.mode == ModeMount {
		// The runtime needs something at the destination; the volume is
		// mounted over it at StartContainer.
		adj.AddMount(&nriapi.Mount{Destination: c.Destination, Type: "tmpfs", Source: "mountplan-pending",
			Options: []string{"ro", "nosuid", "nodev", "noexec", "size=4k", "mode=0755", "rprivate"}})
		return held{Claim: c}, nil
	}
	p, err := h.volumes.Prepare(ctx, c)
	if err != nil {
		return held{}, err
	}
	hc := held{Claim: c, volumeID: p.VolumeID, mounts: p.Mounts}
	oci, err := ociMounts(c.Destination, p.Mounts)
	if err != nil {
		return hc, err
	}
	for _, m := range oci {
		adj.AddMount(m)
	}
	return hc, nil
}

// StartContainer comes once the container's namespace exists and before
// its process runs. In ModeMount the mounter performs the plans there.
func (h *Hook) StartContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	if h.mode != ModeMount {
		return nil
	}
	h.mu.Lock()
	claims := slices.Clone(h.claims[ctr.GetId()])
	h.mu.Unlock()
	for i := range claims {
		c := &claims[i]
		c.PID = int(ctr.GetPid())
		p, err := h.volumes.Prepare(ctx, c.Claim)
		if err != nil {
			return fmt.Errorf("mountplan: volume at %s of container %s: %w", c.Destination, ctr.GetName(), err)
		}
		c.volumeID, c.mounts = p.VolumeID, p.Mounts
		if err := h.mounter.Mount(ctx, p.Mounts, plan.Consumer{PID: c.PID, MountPoint: c.Destination}); err != nil {
			return fmt.Errorf("mountplan: mounting the volume at %s of container %s: %w", c.Destination, ctr.GetName(), err)
		}
	}
	h.mu.Lock()
	h.claims[ctr.GetId()] = claims
	h.mu.Unlock()
	return nil
}

// StopContainer releases the container's claims: its namespace, and the
// volume's mounts in it, are gone or about to be.
func (h *Hook) StopContainer(ctx context.Context, _ *nriapi.PodSandbox, ctr *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	return nil, h.forget(ctx, ctr.GetId())
}

// RemoveContainer releases what StopContainer did not (a container created
// and removed without running).
func (h *Hook) RemoveContainer(ctx context.Context, _ *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.forget(ctx, ctr.GetId())
}

func (h *Hook) forget(ctx context.Context, id string) error {
	h.mu.Lock()
	claims := h.claims[id]
	delete(h.claims, id)
	h.mu.Unlock()
	return h.release(ctx, claims)
}

func (h *Hook) release(ctx context.Context, claims []held) error {
	var errs []error
	for _, c := range claims {
		if c.volumeID == "" {
			continue
		}
		if err := h.volumes.Release(ctx, c.volumeID, c.Claim); err != nil {
			errs = append(errs, fmt.Errorf("releasing volume %s of container %s: %w", c.volumeID, c.ContainerID, err))
		}
	}
	return errors.Join(errs...)
}
