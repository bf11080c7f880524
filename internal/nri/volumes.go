package nri

import (
	"context"
	"strings"
	"unicode"

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

// podOf is who c's container is, nil when the runtime did not say, or
// named it in a way no Kubernetes object is named (a pod made with crictl
// may be): the plugin refuses such names, and the name is only shown, so
// the container must not fail over it.
func podOf(c Claim) *api.PodRef {
	p := c.Pod
	if p == (PodRef{}) || !showable(p.Namespace) || !showable(p.Name) || !showable(p.UID) || !showable(p.Container) {
		return nil
	}
	return &api.PodRef{Namespace: p.Namespace, Name: p.Name, Uid: p.UID, Container: p.Container}
}

// showable: at most 253 bytes, no slash, space or control character (the
// plugin's rule for a pod's names).
func showable(s string) bool {
	return len(s) <= 253 && !strings.ContainsFunc(s, func(r rune) bool { return r == '/' || unicode.IsSpace(r) || !unicode.IsPrint(r) })
}

func consumerOf(c Claim) *api.Consumer {
	return plan.ConsumerToProto(plan.Consumer{PID: c.PID, MountPoint: c.Destination, ContainerID: c.ContainerID})
}
