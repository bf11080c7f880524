package driver

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/volview"
	"github.com/mountplan/mountplan/pkg/plan"
)

// healthTimeout bounds the health check of one volume in a listing.
const healthTimeout = 5 * time.Second

// Volumes lists every volume the records hold, with its consumers, for
// the operator's view (volview; /debug/volumes). It reads the last record
// committed of each volume, so it neither takes nor waits for a volume's
// lock, and health comes from NodeGetVolumeHealth. The kernel is not
// checked here: the caller does that (volview.Proc.Check) from where it
// can see the consumers' processes.
func (d *Driver) Volumes(ctx context.Context) *volview.Report {
	r := &volview.Report{Node: d.opts.NodeID, Time: time.Now().UTC(), Volumes: []volview.Volume{}}
	vols, err := d.records.List()
	if err != nil {
		r.Errors = append(r.Errors, err.Error())
	}
	for _, v := range vols {
		r.Volumes = append(r.Volumes, d.viewVolume(ctx, v))
	}
	return r
}

func (d *Driver) viewVolume(ctx context.Context, v *model.Volume) volview.Volume {
	out := volview.Volume{ID: v.ID, Type: v.Type, Kind: string(v.Kind), Stage: "unstaged", Health: volview.Health{Status: "-"}}
	if v.Image != "" {
		out.Source = "image " + v.Image
	}
	if v.Stage != nil {
		out.Stage, out.StagingPath, out.Block = string(v.Stage.Phase), v.Stage.StagingPath, v.Stage.Block
	}
	if s, ok := d.sources[v.Type].(source.Describer); ok {
		desc := s.Describe(viewOf(v))
		out.Source, out.Device, out.DaemonPID = desc.Source, desc.Device, desc.DaemonPID
	}
	if v.Staged() {
		out.Health = d.viewHealth(ctx, v.ID)
	}
	for _, p := range v.Publishes {
		c := volview.Consumer{Kind: volview.KindPublish, Path: p.TargetPath, ReadOnly: p.ReadOnly, Pod: viewPod(p.Pod)}
		if c.Pod == nil {
			// Recorded without podInfoOnMount (or before the plugin kept
			// it): kubelet's target path still says which pod.
			if uid := volview.PodUIDOfTarget(d.kubelet.root, p.TargetPath); uid != "" {
				c.Pod = &volview.Pod{UID: uid}
			}
		}
		if p.NRI {
			c.Kind = volview.KindNRIPublish
			if dev, ok := deviceOf(p.Mounts); ok && v.Stage != nil && v.Stage.Block {
				c.DeviceNode = fmt.Sprintf("%d:%d", dev.Major, dev.Minor)
			}
		}
		out.Consumers = append(out.Consumers, c)
	}
	for _, c := range v.Consumers {
		out.Consumers = append(out.Consumers, volview.Consumer{Kind: volview.KindContainer, Path: c.MountPoint,
			ReadOnly: readOnlyPlan(c.Mounts), PID: c.PID, MountNS: c.Namespace.Inode, ContainerID: c.ContainerID, Pod: viewPod(c.Pod)})
	}
	return out
}

// viewPod is a recorded pod as the listing shows it; nil when nothing was
// recorded.
func viewPod(p model.Pod) *volview.Pod {
	if p == (model.Pod{}) {
		return nil
	}
	return &volview.Pod{Namespace: p.Namespace, Name: p.Name, UID: p.UID, Container: p.Container}
}

// viewHealth is NodeGetVolumeHealth's answer for volume id.
func (d *Driver) viewHealth(ctx context.Context, id string) volview.Health {
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	resp, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		return volview.Health{Status: "-", Message: err.Error()}
	}
	for _, e := range resp.GetVolumeHealth().GetHealthStatuses() {
		return volview.Health{Status: e.GetStatus().String(), Reason: e.GetReason(), Message: e.GetMessage()}
	}
	return volview.Health{Status: "ok"}
}

// readOnlyPlan says whether the last mount of a plan, the one at the
// consumer's mount point, is read-only.
func readOnlyPlan(ms []plan.Mount) bool {
	if len(ms) == 0 {
		return false
	}
	return ms[len(ms)-1].HasOption("ro")
}
