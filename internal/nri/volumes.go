package nri

import (
	"context"

	"github.com/mountplan/mountplan/internal/errdefs"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// PluginVolumes is Volumes through the plugin's NodePrepare service.
type PluginVolumes struct{ Client api.NodePrepareClient }

var _ Volumes = PluginVolumes{}

func (p PluginVolumes) Prepare(ctx context.Context, c Claim) (string, []plan.Mount, error) {
	resp, err := p.Client.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{
		Published: &api.PublishedVolume{TargetPath: c.Target, DeviceMajor: c.Major, DeviceMinor: c.Minor},
		Readonly:  c.ReadOnly,
		Consumer:  consumerOf(c),
		Pod:       podOf(c),
	})
	if err != nil {
		return "", nil, errdefs.FromGRPC(err)
	}
	return resp.GetVolumeId(), plan.FromProto(resp.GetMounts()), nil
}

func (p PluginVolumes) Release(ctx context.Context, c Claim) error {
	_, err := p.Client.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: c.VolumeID, Consumer: consumerOf(c)})
	return errdefs.FromGRPC(err)
}

func (p PluginVolumes) Sync(ctx context.Context, ids []string) error {
	_, err := p.Client.NodeSyncContainers(ctx, &api.NodeSyncContainersRequest{ContainerIds: ids})
	return errdefs.FromGRPC(err)
}

// podOf is who c's container is, nil when the runtime did not say.
func podOf(c Claim) *api.PodRef {
	if c.Pod == (PodRef{}) {
		return nil
	}
	return &api.PodRef{Namespace: c.Pod.Namespace, Name: c.Pod.Name, Uid: c.Pod.UID, Container: c.Pod.Container}
}

func consumerOf(c Claim) *api.Consumer {
	return plan.ConsumerToProto(plan.Consumer{PID: c.PID, MountPoint: c.Destination, ContainerID: c.ContainerID})
}
