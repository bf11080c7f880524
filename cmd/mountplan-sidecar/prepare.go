package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// mountRequest is what the mount command asks of the plugin.
type mountRequest struct {
	VolumeID    string
	StagingPath string
	ReadOnly    bool
	Block       bool // raw block access instead of a filesystem
	Consumer    plan.Consumer
}

// releaseTimeout bounds the NodeUnprepareVolume call that releases a claim
// after a failure, which may come after the caller's deadline has passed.
const releaseTimeout = 30 * time.Second

// prepareAndMount asks the plugin for a volume's plan (NodePrepareVolume),
// performs it with m and returns the consumer as the plugin recorded it.
// When the plan cannot be performed, it releases the claim again so that it
// does not leak.
func prepareAndMount(ctx context.Context, np api.NodePrepareClient, m mounter.Interface, r mountRequest) (plan.Consumer, error) {
	resp, err := np.NodePrepareVolume(ctx, r.proto())
	if err != nil {
		return plan.Consumer{}, fmt.Errorf("NodePrepareVolume %s: %w", r.VolumeID, errdefs.FromGRPC(err))
	}
	c := r.Consumer
	c.Namespace = plan.Namespace{Inode: resp.GetConsumer().GetMntNsInode(), ID: resp.GetConsumer().GetMntNsId()}
	mounts := plan.FromProto(resp.GetMounts())
	if err = checkReadOnly(r, mounts); err == nil {
		err = m.Mount(ctx, mounts, c)
	}
	if err == nil {
		return c, nil
	}
	err = fmt.Errorf("perform plan of %s: %w", r.VolumeID, err)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if rerr := release(rctx, np, r.VolumeID, c); rerr != nil {
		return c, errors.Join(err, rerr)
	}
	klog.FromContext(ctx).V(2).Info("Released the claim of a plan that failed", "volumeID", r.VolumeID)
	return c, err
}

// treeUnmounter removes everything mounted at and below a consumer's mount
// point; *mounter.Executor implements it.
type treeUnmounter interface {
	UnmountAll(ctx context.Context, c plan.Consumer) error
}

// unmountAndRelease unmounts everything at and below the consumer's mount
// point, then releases the claim (NodeUnprepareVolume). It needs no plan,
// so it works after the plugin lost its state. While anything is still
// mounted the claim is kept.
func unmountAndRelease(ctx context.Context, np api.NodePrepareClient, u treeUnmounter, volumeID string, c plan.Consumer) error {
	if err := u.UnmountAll(ctx, c); err != nil {
		return fmt.Errorf("unmount %s: %w", volumeID, err)
	}
	return release(ctx, np, volumeID, c)
}

func release(ctx context.Context, np api.NodePrepareClient, volumeID string, c plan.Consumer) error {
	_, err := np.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: volumeID, Consumer: plan.ConsumerToProto(c)})
	if err != nil {
		return fmt.Errorf("NodeUnprepareVolume %s: %w", volumeID, errdefs.FromGRPC(err))
	}
	return nil
}

// checkReadOnly refuses a writable mount in the plan of a read-only request:
// the consumer asked for read-only, whatever the plugin answered.
func checkReadOnly(r mountRequest, mounts []plan.Mount) error {
	if !r.ReadOnly {
		return nil
	}
	for i, m := range mounts {
		if !m.HasOption("ro") {
			return fmt.Errorf("mount %d (%s %s) of a read-only request lacks ro: %w", i, m.Type, m.Source, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func (r mountRequest) proto() *api.NodePrepareVolumeRequest {
	mode := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	if r.ReadOnly {
		mode = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	}
	vc := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if r.Block {
		vc.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		vc.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}
	}
	return &api.NodePrepareVolumeRequest{
		VolumeId:          r.VolumeID,
		StagingTargetPath: r.StagingPath,
		VolumeCapability:  vc,
		Readonly:          r.ReadOnly,
		Consumer:          plan.ConsumerToProto(r.Consumer),
	}
}
