package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// NodePrepareVolume answers with the plan of a staged volume and records
// who will perform it. Nothing is mounted here: the caller mounts inside
// the consumer's namespace.
func (d *Driver) NodePrepareVolume(ctx context.Context, req *api.NodePrepareVolumeRequest) (*api.NodePrepareVolumeResponse, error) {
	if req.GetPublished() != nil {
		return d.preparePublished(ctx, req)
	}
	id := req.GetVolumeId()
	c, err := d.checkStaged(ctx, id, req.GetStagingTargetPath(), req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	cons, err := plan.ConsumerFromProto(req.GetConsumer())
	if err != nil {
		return nil, err
	}
	pod, err := podOfRequest(req.GetPod())
	if err != nil {
		return nil, err
	}
	if cons.PID == 0 || cons.ContainerID != "" {
		return nil, invalid("consumer.pid must be a positive process id (a container consumer names the volume by its publish)")
	}
	v, unlock, err := d.records.Locked(id, "NodePrepareVolume")
	defer unlock()
	if err != nil {
		return nil, err
	}
	mounts, err := d.addConsumer(ctx, v, &cons, pod, c, req.GetStagingTargetPath(), req.GetReadonly())
	if err != nil {
		return nil, err
	}
	return &api.NodePrepareVolumeResponse{Mounts: plan.ToProto(mounts), Consumer: plan.ConsumerToProto(cons)}, nil
}

// addConsumer records cons (who is pod, when the caller says) as a
// consumer of the staged v and returns the plan it is to perform; a
// repeated call gets the recorded plan.
func (d *Driver) addConsumer(ctx context.Context, v *model.Volume, cons *plan.Consumer, pod model.Pod, c capability, stagingPath string, readOnly bool) ([]plan.Mount, error) {
	if !v.Staged() {
		return nil, fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if err := checkStagingPath(v, stagingPath); err != nil {
		return nil, err
	}
	if v.Stage.Block != c.block {
		return nil, invalid("volume %s is staged for %s access", v.ID, accessName(v.Stage.Block))
	}
	ns, err := d.node.IdentifyNamespace(ctx, cons.PID)
	if err != nil {
		return nil, err
	}
	if !cons.Namespace.Matches(ns) {
		return nil, fmt.Errorf("process %d is no longer in mount namespace %s: %w", cons.PID, cons.Namespace, errdefs.ErrFailedPrecondition)
	}
	cons.Namespace = ns
	if i := slices.IndexFunc(v.Consumers, sameConsumer(*cons)); i >= 0 {
		return v.Consumers[i].Mounts, nil // a repeated prepare: same answer
	}
	mounts, err := d.planFor(v, source.PlanRequest{Block: c.block, ReadOnly: readOnly || c.readOnly, MountFlags: c.mountFlags})
	if err != nil {
		return nil, err
	}
	if err := roomForConsumer(v); err != nil {
		return nil, err
	}
	v.Consumers = append(v.Consumers, model.Claim{Consumer: *cons, Mounts: mounts, Pod: pod})
	klog.FromContext(ctx).V(2).Info("Prepared", "pid", cons.PID, "mntns", ns.Inode, "mountPoint", cons.MountPoint)
	return mounts, d.records.Put(v, journal.Runtime)
}

// NodeUnprepareVolume releases a consumer's claim. Idempotent: an unknown
// volume or consumer is already released.
func (d *Driver) NodeUnprepareVolume(ctx context.Context, req *api.NodeUnprepareVolumeRequest) (*api.NodeUnprepareVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	cons, err := plan.ConsumerFromProto(req.GetConsumer())
	if err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodeUnprepareVolume")
	defer unlock()
	if errors.Is(err, errdefs.ErrNotFound) {
		return &api.NodeUnprepareVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	if cons.Namespace.Inode == 0 && cons.PID > 0 {
		// The caller did not keep the namespace identity: the PID still
		// names it if the process lives.
		if ns, err := d.node.IdentifyNamespace(ctx, cons.PID); err == nil {
			cons.Namespace = ns
		}
	}
	n := len(v.Consumers)
	v.Consumers = slices.DeleteFunc(v.Consumers, releasedBy(cons))
	if len(v.Consumers) == n {
		return &api.NodeUnprepareVolumeResponse{}, nil
	}
	return &api.NodeUnprepareVolumeResponse{}, d.records.Put(v, journal.Runtime)
}

// releasedBy matches the records an unprepare request names: by namespace
// identity when the caller knows it (the ID where both sides know it), else
// by PID.
func releasedBy(req plan.Consumer) func(model.Claim) bool {
	return func(c model.Claim) bool {
		if c.MountPoint != req.MountPoint {
			return false
		}
		if req.ContainerID != "" || c.ContainerID != "" {
			return c.ContainerID == req.ContainerID
		}
		if req.Namespace.Inode != 0 {
			return c.Namespace.Inode == req.Namespace.Inode && (req.Namespace.ID == 0 || c.Namespace.ID == 0 || c.Namespace.ID == req.Namespace.ID)
		}
		return c.PID == req.PID
	}
}

// dropDeadConsumers forgets consumers whose namespace is gone (the kernel
// dropped their mounts with it), asking the mounter, which sees every
// process of the node. A container that has not started yet is kept, and
// so is every consumer when the mounter cannot answer. The caller
// persists v.
func (d *Driver) dropDeadConsumers(ctx context.Context, v *model.Volume) bool {
	var ask []plan.Consumer
	for _, c := range v.Consumers {
		if !pendingContainer(c.Consumer) {
			ask = append(ask, c.Consumer)
		}
	}
	if len(ask) == 0 {
		return false
	}
	alive, err := d.node.LiveNamespaces(ctx, ask)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Cannot tell which consumers are gone; keeping them", "volume", v.ID)
		return false
	}
	dead := map[plan.Consumer]bool{}
	for i, c := range ask {
		if !alive[i] {
			dead[c] = true
		}
	}
	n := len(v.Consumers)
	v.Consumers = slices.DeleteFunc(v.Consumers, func(c model.Claim) bool {
		if dead[c.Consumer] {
			klog.FromContext(ctx).Info("Dropping consumer whose mount namespace is gone", "volume", v.ID, "pid", c.PID, "mntns", c.Namespace.Inode)
			return true
		}
		return false
	})
	return len(v.Consumers) != n
}
