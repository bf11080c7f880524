package driver

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/pkg/plan"
)

// bootSource is a provisioner (the loop source's images) whose device
// steps are recorded, not performed: which states it was asked to adopt,
// undo, forget or stage with.
type bootSource struct {
	*loop.Source
	adopted, unstaged, forgotten []string // "id state"
	staged                       []string // "id state": the state a stage started from
}

var _ source.Forgetter = (*bootSource)(nil)

func seen(v source.Volume) string { return v.ID + " " + string(v.State) }

func (b *bootSource) Stage(_ context.Context, v source.Volume, _ source.StageRequest) (json.RawMessage, error) {
	b.staged = append(b.staged, seen(v))
	return json.RawMessage(`{"device":"/dev/loop3"}`), nil
}

func (b *bootSource) Plan(source.Volume, source.PlanRequest) ([]plan.Mount, error) {
	return []plan.Mount{{Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev"}}}, nil
}

func (b *bootSource) Unstage(_ context.Context, v source.Volume) error {
	b.unstaged = append(b.unstaged, seen(v))
	return nil
}

func (b *bootSource) Adopt(_ context.Context, v source.Volume) (json.RawMessage, error) {
	b.adopted = append(b.adopted, seen(v))
	return v.State, nil
}

func (b *bootSource) Forget(_ context.Context, v source.Volume) error {
	b.forgotten = append(b.forgotten, seen(v))
	return nil
}

// bootNode is a node whose driver can be started again on the same state
// and kubelet dirs, in a boot the test names.
type bootNode struct {
	t               *testing.T
	state, kubelet  string
	src             *bootSource
	mounter         *recordingMounter
	grace           time.Duration
	stagePath, tgts string
}

func newBootNode(t *testing.T) *bootNode {
	n := &bootNode{t: t, state: t.TempDir(), kubelet: t.TempDir(), mounter: &recordingMounter{}, grace: time.Hour}
	n.stagePath = filepath.Join(n.kubelet, "plugins", "kubernetes.io", "csi", "mountplan.csi.io", "x", "globalmount")
	n.tgts = filepath.Join(n.kubelet, "pods")
	return n
}

// start starts the driver in boot, as mountplan-plugin does at its start.
func (n *bootNode) start(boot string) *Driver {
	n.t.Helper()
	d, err := New(testOptions(n.t, Options{DriverName: "mountplan.csi.io", NodeID: "node-a", StateDir: n.state, KubeletDir: n.kubelet,
		Mounter: n.mounter, BootID: func() (string, error) { return boot, nil }, RebootGrace: n.grace}))
	if err != nil {
		n.t.Fatal(err)
	}
	ls := d.sources[loop.Type].(*loop.Source)
	n.src = &bootSource{Source: ls}
	d.sources[loop.Type] = n.src
	return d
}

func (n *bootNode) target(pod string) string {
	return filepath.Join(n.tgts, pod, "volumes", "v", "mount")
}

// put records v as the driver of the ended boot left it.
func put(t *testing.T, d *Driver, v *model.Volume) {
	t.Helper()
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, d *Driver, id string) *model.Volume {
	t.Helper()
	v, err := d.records.Get(id)
	if err != nil {
		t.Fatalf("record %s: %v", id, err)
	}
	return v
}

func gone(t *testing.T, d *Driver, id string) {
	t.Helper()
	if v, err := d.records.Get(id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("record %s is left: %+v, %v", id, v, err)
	}
}

// The records a driver of boot A left: devices (loop7, a number the new
// boot may give to anything), publishes with targets the plugin made, a
// consumer, inline volumes with their images.
func (n *bootNode) leaveRecords(d *Driver) {
	t := n.t
	stage := func() *model.Stage {
		return &model.Stage{Phase: model.PhaseStaged, StagingPath: n.stagePath, Source: json.RawMessage(`{"device":"/dev/loop7"}`)}
	}
	publish := func(pod string) []model.Publish {
		tgt := n.target(pod)
		if err := os.MkdirAll(tgt, 0o750); err != nil {
			t.Fatal(err)
		}
		return []model.Publish{{TargetPath: tgt, CreatedTarget: true, Mounts: []plan.Mount{{Type: "ext4", Source: "/dev/loop7"}}}}
	}
	image := func(kind model.Kind, id string) string {
		p := n.src.ImagePath(kind, id)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, v := range []*model.Volume{
		{ID: "pvc-asked", Kind: model.KindProvisioned, Type: loop.Type, Image: image(model.KindProvisioned, "pvc-asked"),
			Format: &model.Format{FsType: "ext4", Done: true}, Stage: stage(), Publishes: publish("asked"),
			Consumers: []model.Claim{{Consumer: plan.Consumer{PID: 1, MountPoint: "/data", Namespace: plan.Namespace{Inode: 9}}}}},
		{ID: "pvc-unasked", Kind: model.KindProvisioned, Type: loop.Type, Image: image(model.KindProvisioned, "pvc-unasked"),
			Format: &model.Format{FsType: "ext4", Done: true}, Stage: stage(), Publishes: publish("unasked")},
		{ID: "pvc-interrupted", Kind: model.KindProvisioned, Type: loop.Type, Image: image(model.KindProvisioned, "pvc-interrupted"),
			Stage: &model.Stage{Phase: model.PhaseUnstaging, StagingPath: n.stagePath, Source: json.RawMessage(`{"device":"/dev/loop8"}`)}},
		{ID: "pvc-idle", Kind: model.KindProvisioned, Type: loop.Type, Image: image(model.KindProvisioned, "pvc-idle")},
		{ID: "static-unasked", Kind: model.KindStatic, Type: loop.Type, Image: "/images/a.img", Stage: stage()},
		{ID: "inline-asked", Kind: model.KindEphemeral, Type: loop.Type, Image: image(model.KindEphemeral, "inline-asked"),
			FsType: "ext4", Stage: stage(), Publishes: publish("inline-asked")},
		{ID: "inline-unpublished", Kind: model.KindEphemeral, Type: loop.Type, Image: image(model.KindEphemeral, "inline-unpublished"),
			FsType: "ext4", Stage: stage(), Publishes: publish("inline-unpublished")},
		{ID: "inline-unasked", Kind: model.KindEphemeral, Type: loop.Type, Image: image(model.KindEphemeral, "inline-unasked"),
			FsType: "ext4", Stage: stage(), Publishes: publish("inline-unasked")},
	} {
		put(t, d, v)
	}
}

// TestRebootStagesAfreshOrDrops: a driver that starts in a boot it did
// not see trusts nothing its records say of the ended boot's devices,
// mounts and consumers; it stages again what kubelet asks for, drops
// what kubelet gives up, and after the grace what no one asked for,
// keeping what is on disk until DeleteVolume.
func TestRebootStagesAfreshOrDrops(t *testing.T) {
	n := newBootNode(t)
	ctx := context.Background()
	a := n.start("boot-a")
	if a.RebootedFrom() != "" {
		t.Fatalf("a new state dir is taken as rebooted from %q", a.RebootedFrom())
	}
	n.leaveRecords(a)

	// The same boot again (a restart of the plugin): records adopted as before.
	a = n.start("boot-a")
	if a.RebootedFrom() != "" || a.AwaitingRestage() != 0 || !get(t, a, "pvc-asked").Staged() {
		t.Fatalf("a restart in the same boot marked records: from %q, %d awaiting", a.RebootedFrom(), a.AwaitingRestage())
	}

	// The node reboots.
	d := n.start("boot-b")
	if d.RebootedFrom() != "boot-a" {
		t.Fatalf("RebootedFrom = %q, want boot-a", d.RebootedFrom())
	}
	if last, err := journal.OpenBoot(n.state).Last(); err != nil || last != "boot-b" {
		t.Fatalf("recorded boot = %q, %v; want boot-b", last, err)
	}
	if got := d.AwaitingRestage(); got != 7 {
		t.Errorf("AwaitingRestage = %d, want 7 (every volume with a stage)", got)
	}
	for _, id := range []string{"pvc-asked", "pvc-interrupted", "static-unasked", "inline-unasked"} {
		v := get(t, d, id)
		if v.Stage != nil || v.Publishes != nil || v.Consumers != nil || v.Rebooted == nil || v.Rebooted.Boot != "boot-a" || v.Rebooted.Stage == nil {
			t.Errorf("%s not marked as of the ended boot: %+v", id, v)
		}
	}
	if v := get(t, d, "pvc-idle"); v.Rebooted != nil {
		t.Errorf("an idle volume is marked: %+v", v.Rebooted)
	}

	// The startup reconcile asks the source nothing about the ended boot
	// and keeps everything within the grace (inline images too).
	if err := d.Reconcile(ctx); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if len(n.src.adopted)+len(n.src.unstaged)+len(n.src.forgotten) != 0 {
		t.Fatalf("the ended boot's devices were probed: adopted %v, undone %v, forgotten %v", n.src.adopted, n.src.unstaged, n.src.forgotten)
	}
	for _, id := range []string{"pvc-asked", "pvc-unasked", "static-unasked", "inline-asked", "inline-unasked"} {
		get(t, d, id)
	}

	// Kubelet stages and publishes again for the pods still on the node.
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-asked", StagingTargetPath: n.stagePath, VolumeCapability: rwo}); err != nil {
		t.Fatalf("NodeStageVolume after the reboot: %v", err)
	}
	if !slices.Equal(n.src.staged, []string{"pvc-asked "}) {
		t.Errorf("the stage did not start afresh: %v", n.src.staged)
	}
	if !slices.Equal(n.src.forgotten, []string{`pvc-asked {"device":"/dev/loop7"}`}) {
		t.Errorf("what the ended boot's stage left was not forgotten once, by its state: %v", n.src.forgotten)
	}
	if v := get(t, d, "pvc-asked"); !v.Staged() || v.Rebooted != nil || string(v.Stage.Source) != `{"device":"/dev/loop3"}` {
		t.Errorf("after the stage: %+v", v)
	}
	calls := n.mounter.calls
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "pvc-asked", StagingTargetPath: n.stagePath,
		TargetPath: n.target("asked"), VolumeCapability: rwo}); err != nil {
		t.Fatalf("NodePublishVolume after the reboot: %v", err)
	}
	if v := get(t, d, "pvc-asked"); n.mounter.calls != calls+1 || len(v.Publishes) != 1 || !v.Publishes[0].CreatedTarget {
		t.Errorf("the publish was not performed again, at a target the plugin made: %d mounter calls, %+v", n.mounter.calls-calls, v.Publishes)
	}
	ephemeral := map[string]string{ctxEphemeral: "true", "size": "64Mi"}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "inline-asked", TargetPath: n.target("inline-asked"),
		VolumeCapability: rwo, VolumeContext: ephemeral}); err != nil {
		t.Fatalf("NodePublishVolume of an inline volume after the reboot: %v", err)
	}
	if v := get(t, d, "inline-asked"); !v.Staged() || v.Rebooted != nil || len(v.Publishes) != 1 {
		t.Errorf("the inline volume was not staged and published again: %+v", v)
	}
	if _, err := os.Stat(n.src.ImagePath(model.KindEphemeral, "inline-asked")); err != nil {
		t.Errorf("the inline volume's image (its data) is gone: %v", err)
	}

	// Kubelet gives up what belonged to pods that are gone.
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "inline-unpublished", TargetPath: n.target("inline-unpublished")}); err != nil {
		t.Fatalf("NodeUnpublishVolume of an inline volume of the ended boot: %v", err)
	}
	gone(t, d, "inline-unpublished")
	if _, err := os.Stat(n.src.ImagePath(model.KindEphemeral, "inline-unpublished")); !os.IsNotExist(err) {
		t.Errorf("the image of an inline volume kubelet unpublished is left: %v", err)
	}
	if _, err := os.Stat(n.target("inline-unpublished")); !os.IsNotExist(err) {
		t.Errorf("the target the plugin made is left: %v", err)
	}
	if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-interrupted", StagingTargetPath: n.stagePath}); err != nil {
		t.Fatalf("NodeUnstageVolume of a stage of the ended boot: %v", err)
	}
	if v := get(t, d, "pvc-interrupted"); v.Rebooted != nil || v.Stage != nil {
		t.Errorf("unstage kept what the reboot erased: %+v", v)
	}

	// The grace ends with the rest unasked.
	n.grace = time.Nanosecond
	d = n.start("boot-b")
	if d.RebootedFrom() != "" {
		t.Errorf("a restart in the new boot is taken as another reboot (from %q)", d.RebootedFrom())
	}
	if err := d.Reconcile(ctx); err != nil {
		t.Fatalf("Reconcile after the grace: %v", err)
	}
	if got := d.AwaitingRestage(); got != 0 {
		t.Errorf("AwaitingRestage after the grace = %d, want 0", got)
	}
	if v := get(t, d, "pvc-unasked"); v.Rebooted != nil || v.Stage != nil || v.Format == nil || !v.Format.Done {
		t.Errorf("a provisioned volume no one asked for: %+v; want its durable part only", v)
	}
	if _, err := os.Stat(n.src.ImagePath(model.KindProvisioned, "pvc-unasked")); err != nil {
		t.Errorf("a provisioned volume's image went before DeleteVolume: %v", err)
	}
	if _, err := os.Stat(n.target("unasked")); !os.IsNotExist(err) {
		t.Errorf("the target the plugin made for a publish no one asked for again is left: %v", err)
	}
	gone(t, d, "static-unasked")
	gone(t, d, "inline-unasked")
	if _, err := os.Stat(n.src.ImagePath(model.KindEphemeral, "inline-unasked")); !os.IsNotExist(err) {
		t.Errorf("the image of an inline volume no one asked for is left: %v", err)
	}
	for _, id := range []string{"pvc-asked", "inline-asked"} {
		if v := get(t, d, id); !v.Staged() {
			t.Errorf("%s, staged again in the new boot, lost its stage: %+v", id, v)
		}
	}
	if len(n.src.adopted) != 2 || len(n.src.unstaged) != 0 {
		t.Errorf("in the new boot only the volumes staged in it are adopted: adopted %v, undone %v", n.src.adopted, n.src.unstaged)
	}
	for _, f := range n.src.forgotten {
		if !strings.Contains(f, "/dev/loop") {
			t.Errorf("Forget got no state of the ended boot: %q", f)
		}
	}
}

// TestRebootTwiceKeepsTheOlderStage: a second reboot before anyone asked
// keeps the first boot's stage for its source to forget.
func TestRebootTwiceKeepsTheOlderStage(t *testing.T) {
	n := newBootNode(t)
	d := n.start("boot-a")
	put(t, d, &model.Volume{ID: "pvc", Kind: model.KindProvisioned, Type: loop.Type,
		Stage: &model.Stage{Phase: model.PhaseStaged, Source: json.RawMessage(`{"device":"/dev/loop7"}`)}})
	first := get(t, n.start("boot-b"), "pvc").Rebooted
	d = n.start("boot-c")
	v := get(t, d, "pvc")
	if v.Rebooted == nil || v.Rebooted.Boot != "boot-a" || v.Rebooted.Stage == nil || string(v.Rebooted.Stage.Source) != `{"device":"/dev/loop7"}` {
		t.Fatalf("after two reboots: %+v", v.Rebooted)
	}
	if !v.Rebooted.Found.After(first.Found) {
		t.Errorf("the grace does not start again at the second reboot: found %v, then %v", first.Found, v.Rebooted.Found)
	}
}
