package driver

// NRI mode: a volume whose attributes say nri: "true" is published for
// kubelet without its filesystem ever appearing in the host's mount
// namespace. The publish leaves at the target a guard (internal/nri/guard), or
// for block access a device node, and the mounter's NRI hook gives each
// container that uses the target the volume's plan through the container
// runtime, claiming it here for that container (prepareContainer). See
// docs/nri.md.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/internal/source"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// ctxNRI is the volume attribute (StorageClass parameter, PV attribute,
// inline volume attribute) that asks for NRI mode.
const ctxNRI = "nri"

// parseNRI reads the nri attribute: "true", "false" or absent.
func parseNRI(vctx map[string]string) (bool, error) {
	v, ok := vctx[ctxNRI]
	if !ok {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil || (v != "true" && v != "false") {
		return false, invalid("attribute %s must be \"true\" or \"false\", not %q", ctxNRI, v)
	}
	return b, nil
}

// withoutDriverAttributes drops the attributes the driver itself reads
// from a context before a source, which knows only its own, sees it.
func withoutDriverAttributes(vctx map[string]string) map[string]string {
	if _, ok := vctx[ctxNRI]; !ok {
		return vctx
	}
	out := make(map[string]string, len(vctx))
	for k, v := range vctx {
		if k != ctxNRI {
			out[k] = v
		}
	}
	return out
}

// publishNRI publishes v at target in NRI mode: a guard bound there (mount
// access) or a device node of the volume (block access), nothing of the
// volume's filesystem. Recording comes first, as for any publish.
func (d *Driver) publishNRI(ctx context.Context, v *model.Volume, target string, c capability, readOnly bool) error {
	if !d.opts.NRI {
		return fmt.Errorf("volume %s asks for NRI mode (%s: \"true\") but this node's plugin runs without --nri: %w", v.ID, ctxNRI, errdefs.ErrFailedPrecondition)
	}
	if !v.Staged() {
		return fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if v.Stage.Block != c.block {
		return invalid("volume %s is staged for %s access", v.ID, accessName(v.Stage.Block))
	}
	readOnly = readOnly || c.readOnly
	if p := findPublish(v, target); p != nil {
		if !p.NRI || p.ReadOnly != readOnly {
			return fmt.Errorf("volume %s is already published at %s with readonly=%t (NRI mode %t): %w", v.ID, target, p.ReadOnly, p.NRI, errdefs.ErrAlreadyExists)
		}
		if d.nriPublished(ctx, p) {
			return nil
		}
	}
	if err := d.applyMountGroup(ctx, v, c, readOnly); err != nil {
		return err
	}
	prev := findPublish(v, target)
	pub := model.Publish{TargetPath: target, ReadOnly: readOnly, NRI: true, MountFlags: c.mountFlags, Asked: time.Now().UTC(), SingleWriter: c.singleWriter, Pod: c.pod}
	if c.block {
		mounts, err := d.planFor(v, source.PlanRequest{Block: true, ReadOnly: readOnly})
		if err != nil {
			return err
		}
		pub.Mounts = mounts
	} else {
		src, err := guard.Source(d.opts.StateDir)
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("volume %s is in NRI mode and no mountplan NRI hook is registered with the container runtime (no %s): "+
				"no container could get it: %w", v.ID, guard.Path(d.opts.StateDir), errdefs.ErrUnavailable)
		}
		if err != nil {
			return err
		}
		// The target's own directory in the guard: a subPath kubelet binds
		// from it leads the hook back to this target.
		pub.Mounts = []plan.Mount{guard.Bind(guard.At(src, target))}
	}
	var created bool
	var err error
	if c.block {
		created, err = d.makeDeviceNode(ctx, target, pub.Mounts)
	} else {
		created, err = d.node.MakeTarget(ctx, target, false)
	}
	if err != nil {
		return err
	}
	pub.CreatedTarget = created || (prev != nil && prev.CreatedTarget)
	v.Publishes = slices.DeleteFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	v.Publishes = append(v.Publishes, pub)
	if err := d.records.Put(v, journal.Runtime); err != nil {
		return err
	}
	if !c.block {
		err = d.opts.Mounter.Mount(ctx, pub.Mounts, plan.Consumer{MountPoint: target})
	}
	if err != nil && !d.nriPublished(ctx, &pub) && !mayStillMount(err) {
		v.Publishes = v.Publishes[:len(v.Publishes)-1]
		var rmErr error
		if pub.CreatedTarget {
			rmErr = d.node.RemoveTarget(ctx, target)
		}
		return errors.Join(err, rmErr, d.records.Put(v, journal.Runtime))
	}
	klog.FromContext(ctx).V(2).Info("Published for containers only (NRI)", "volume", v.ID, "target", target, "block", c.block)
	return err
}

// nriPublished reports whether what an NRI publish leaves at its target is
// there: a guard (live or not: a new mounter re-arms dead ones) or the
// device node.
func (d *Driver) nriPublished(ctx context.Context, p *model.Publish) bool {
	if dev, ok := deviceOf(p.Mounts); ok {
		st, err := d.node.TargetState(ctx, p.TargetPath)
		return err == nil && st.Device != nil && rdevOf(*st.Device) == rdevOf(dev)
	}
	return d.isMountPoint(ctx, p.TargetPath)
}

// deviceOf returns the device a block plan binds, its number read from
// sysfs (the plugin has no /dev of the host).
func deviceOf(mounts []plan.Mount) (mounter.Device, bool) {
	if src, ok := deviceBindSource(mounts); ok {
		if major, minor, err := sysfsDevice(src); err == nil {
			return mounter.Device{Path: src, Major: major, Minor: minor}, true
		}
	}
	return mounter.Device{}, false
}

// deviceBindSource is the device node a block plan binds.
func deviceBindSource(mounts []plan.Mount) (string, bool) {
	for _, m := range mounts {
		if m.IsDeviceBind() {
			return m.Source, true
		}
	}
	return "", false
}

func rdevOf(d mounter.Device) uint64 { return unix.Mkdev(d.Major, d.Minor) }

// makeDeviceNode has the mounter create at target a block device node of
// the device the plan binds: kubelet and the runtime see a device there
// (the runtime creates it in the container), and nothing is mounted. The
// mounter makes the parents too. It reports whether the node was created.
func (d *Driver) makeDeviceNode(ctx context.Context, target string, mounts []plan.Mount) (bool, error) {
	dev, ok := deviceOf(mounts)
	if !ok {
		return false, fmt.Errorf("block plan names no block device: %w", errdefs.ErrFailedPrecondition)
	}
	return d.node.MakeDeviceNode(ctx, target, dev)
}

// preparePublished answers NodePrepareVolume for a container consumer that
// names the volume by its NRI publish (the runtime hook).
func (d *Driver) preparePublished(ctx context.Context, req *api.NodePrepareVolumeRequest) (*api.NodePrepareVolumeResponse, error) {
	cons, err := plan.ConsumerFromProto(req.GetConsumer())
	if err != nil {
		return nil, err
	}
	if cons.ContainerID == "" {
		return nil, invalid("a volume named by its publish is prepared for a container: consumer.container_id is required")
	}
	pod, err := podOfRequest(req.GetPod())
	if err != nil {
		return nil, err
	}
	pub := req.GetPublished()
	if pub.GetTargetPath() != "" {
		if err := requirePath("published.target_path", pub.GetTargetPath()); err != nil {
			return nil, err
		}
	}
	id, err := d.findNRIPublish(pub)
	if err != nil {
		return nil, err
	}
	v, unlock, err := d.records.Locked(id, "NodePrepareVolume")
	defer unlock()
	if err != nil {
		return nil, err
	}
	p := findPublishOf(v, pub)
	if p == nil {
		return nil, fmt.Errorf("volume %s is no longer published there: %w", id, errdefs.ErrNotFound)
	}
	mounts, err := d.prepareContainer(ctx, v, &cons, pod, p, req.GetReadonly())
	if err != nil {
		return nil, err
	}
	return &api.NodePrepareVolumeResponse{Mounts: plan.ToProto(mounts), Consumer: plan.ConsumerToProto(cons), VolumeId: id}, nil
}

// findNRIPublish returns the ID of the volume with an NRI publish that pub
// names. Not found is NotFound: a container's mount that is not ours.
func (d *Driver) findNRIPublish(pub *api.PublishedVolume) (string, error) {
	if pub.GetTargetPath() == "" && pub.GetDeviceMajor() == 0 && pub.GetDeviceMinor() == 0 {
		return "", invalid("published needs a target_path or a device number")
	}
	vols, err := d.records.List()
	if err != nil {
		return "", err
	}
	for _, v := range vols {
		if findPublishOf(v, pub) != nil {
			return v.ID, nil
		}
	}
	return "", fmt.Errorf("no volume is published in NRI mode at %s (device %d:%d): %w",
		pub.GetTargetPath(), pub.GetDeviceMajor(), pub.GetDeviceMinor(), errdefs.ErrNotFound)
}

// findPublishOf returns v's NRI publish at pub's target path, or, for a
// device number, v's NRI block publish of that device.
func findPublishOf(v *model.Volume, pub *api.PublishedVolume) *model.Publish {
	for i := range v.Publishes {
		p := &v.Publishes[i]
		if !p.NRI {
			continue
		}
		if t := pub.GetTargetPath(); t != "" {
			if p.TargetPath == t {
				return p
			}
			continue
		}
		if dev, ok := deviceOf(p.Mounts); ok && dev.Major == pub.GetDeviceMajor() && dev.Minor == pub.GetDeviceMinor() {
			return p
		}
	}
	return nil
}

// prepareContainer records a container as a consumer of v (as published
// by p) and returns the plan its runtime performs. The container's process
// may not exist yet: a later call with its PID records its namespace, so
// that the reconciler can tell when it is gone. pod, who the container
// is, is recorded with it (and added to a claim recorded without it).
func (d *Driver) prepareContainer(ctx context.Context, v *model.Volume, cons *plan.Consumer, pod model.Pod, p *model.Publish, readOnly bool) ([]plan.Mount, error) {
	if !v.Staged() {
		return nil, fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if cons.PID != 0 {
		ns, err := d.node.IdentifyNamespace(ctx, cons.PID)
		if err != nil {
			return nil, err
		}
		cons.Namespace = ns
	}
	if i := slices.IndexFunc(v.Consumers, sameConsumer(*cons)); i >= 0 {
		c := &v.Consumers[i]
		learnsPod := c.Pod == (model.Pod{}) && pod != (model.Pod{})
		if cons.PID == 0 || c.Namespace == cons.Namespace {
			*cons = c.Consumer
			if !learnsPod {
				return c.Mounts, nil // a repeated prepare: same answer
			}
			c.Pod = pod // a claim recorded before pods were
			return c.Mounts, d.records.Put(v, journal.Runtime)
		}
		c.PID, c.Namespace = cons.PID, cons.Namespace
		if learnsPod {
			c.Pod = pod
		}
		klog.FromContext(ctx).V(2).Info("Container consumer started", "volume", v.ID, "container", cons.ContainerID, "pid", cons.PID, "mntns", cons.Namespace.Inode)
		return c.Mounts, d.records.Put(v, journal.Runtime)
	}
	mounts, err := d.planFor(v, source.PlanRequest{Block: v.Stage.Block, ReadOnly: readOnly || p.ReadOnly, MountFlags: p.MountFlags})
	if err != nil {
		return nil, err
	}
	if err := roomForConsumer(v); err != nil {
		return nil, err
	}
	v.Consumers = append(v.Consumers, model.Claim{Consumer: *cons, Mounts: mounts, Pod: pod})
	klog.FromContext(ctx).V(2).Info("Prepared for a container", "volume", v.ID, "container", cons.ContainerID, "mountPoint", cons.MountPoint, "pid", cons.PID)
	return mounts, d.records.Put(v, journal.Runtime)
}

// NodeSyncContainers releases the claims of containers the runtime no
// longer has.
func (d *Driver) NodeSyncContainers(ctx context.Context, req *api.NodeSyncContainersRequest) (*api.NodeSyncContainersResponse, error) {
	live := map[string]bool{}
	for _, id := range req.GetContainerIds() {
		live[id] = true
	}
	gone := func(c model.Claim) bool { return c.ContainerID != "" && !live[c.ContainerID] }
	vols, err := d.records.List()
	if err != nil {
		return nil, err
	}
	var released uint32
	var errs []error
	for _, listed := range vols {
		if !slices.ContainsFunc(listed.Consumers, gone) {
			continue
		}
		// The list is the runtime's as the hook sent it: once the hook
		// has given up on this call (and registers again), a container
		// created since would lose its claim to it.
		if err := ctx.Err(); err != nil {
			return &api.NodeSyncContainersResponse{Released: released}, errors.Join(append(errs, err)...)
		}
		n, err := d.releaseClaims(ctx, listed.ID, gone)
		released += n
		errs = append(errs, err)
	}
	return &api.NodeSyncContainersResponse{Released: released}, errors.Join(errs...)
}

// releaseClaims drops the claims of volume id that match.
func (d *Driver) releaseClaims(ctx context.Context, id string, match func(model.Claim) bool) (uint32, error) {
	v, unlock, err := d.records.Locked(id, "NodeSyncContainers")
	defer unlock()
	if errors.Is(err, errdefs.ErrNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := len(v.Consumers)
	v.Consumers = slices.DeleteFunc(v.Consumers, func(c model.Claim) bool {
		if match(c) {
			klog.FromContext(ctx).Info("Releasing the claim of a container the runtime no longer has", "volume", id, "container", c.ContainerID, "mountPoint", c.MountPoint)
			return true
		}
		return false
	})
	if len(v.Consumers) == n {
		return 0, nil
	}
	return uint32(n - len(v.Consumers)), d.records.Put(v, journal.Runtime)
}

// statsNRI answers NodeGetVolumeStats for an NRI publish, which holds no
// filesystem: through the mount point inside a running container that
// uses the volume, resolved within that container's root.
func (d *Driver) statsNRI(ctx context.Context, v *model.Volume, p *model.Publish) (*csi.NodeGetVolumeStatsResponse, error) {
	if v.Stage != nil && v.Stage.Block {
		if dev, ok := deviceBindSource(p.Mounts); ok {
			return d.statsOf(ctx, v, dev)
		}
	}
	for _, c := range v.Consumers {
		if c.ContainerID == "" || c.PID == 0 {
			continue
		}
		u, err := d.node.StatFS(ctx, c.Consumer)
		if err != nil {
			continue // that container is gone: another may still run
		}
		return usageResponse(u), nil
	}
	return d.statsStopped(ctx, v, p)
}

// statsStopped measures an NRI volume none of whose containers runs. A
// plan that binds a mount of the state dir (a chain's overlay, a FUSE
// daemon's mount) is measured there, where it stays mounted while the
// volume is staged, as a classic publish is through the bind of it. A plan
// that mounts a device: the mounter mounts it privately (the filesystem is
// mounted nowhere else then, or its running containers share the
// superblock) and measures it.
func (d *Driver) statsStopped(ctx context.Context, v *model.Volume, p *model.Publish) (*csi.NodeGetVolumeStatsResponse, error) {
	notFound := fmt.Errorf("volume %s is published in NRI mode at %s and no running container uses it: %w", v.ID, p.TargetPath, errdefs.ErrNotFound)
	mounts, err := d.planFor(v, source.PlanRequest{ReadOnly: p.ReadOnly, MountFlags: p.MountFlags})
	if err != nil {
		return nil, errors.Join(notFound, err)
	}
	for _, m := range mounts {
		if m.Type == plan.TypeBind && !m.IsDeviceBind() && plan.Within(d.opts.StateDir, m.Source) {
			return d.statsOf(ctx, v, m.Source)
		}
		if m.Type == plan.TypeBind || !strings.HasPrefix(m.Source, "/dev/") {
			continue
		}
		major, minor, err := sysfsDevice(m.Source)
		if err != nil {
			return nil, err
		}
		u, err := d.node.StatDevice(ctx, mounter.Device{Path: m.Source, Major: major, Minor: minor}, m.HasOption("ro"))
		if err != nil {
			return nil, err
		}
		return usageResponse(u), nil
	}
	return nil, notFound
}
