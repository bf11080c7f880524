package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// fakeSource records what the reconciler asks of it.
type fakeSource struct {
	adopted, unstaged []string
	adoptState        json.RawMessage
}

func (f *fakeSource) NewVolume(id string, _ map[string]string) (source.Volume, error) {
	return source.Volume{ID: id, Kind: model.KindStatic}, nil
}

func (f *fakeSource) Stage(context.Context, source.Volume, source.StageRequest) (json.RawMessage, error) {
	return json.RawMessage(`{}`), nil
}

func (f *fakeSource) Plan(source.Volume, source.PlanRequest) ([]plan.Mount, error) {
	return []plan.Mount{{Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev"}}}, nil
}

func (f *fakeSource) Unstage(_ context.Context, v source.Volume) error {
	f.unstaged = append(f.unstaged, v.ID)
	return nil
}

func (f *fakeSource) Adopt(_ context.Context, v source.Volume) (json.RawMessage, error) {
	f.adopted = append(f.adopted, v.ID)
	if f.adoptState != nil {
		return f.adoptState, nil
	}
	return v.State, nil
}

// deadPID returns the PID of a process that has exited and been reaped.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatalf("run true: %v", err)
	}
	return cmd.Process.Pid
}

// liveProcess starts a child that lives as long as the test and returns its
// PID and mount namespace: a consumer that is alive, whatever this machine
// lets the test see of other processes (PID 1's namespace may be hidden).
func liveProcess(t *testing.T) (int, plan.Namespace) {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sleep: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	ns, err := mountns.IdentityOf(cmd.Process.Pid)
	if err != nil {
		t.Fatalf("namespace of a child: %v", err)
	}
	return cmd.Process.Pid, ns
}

func TestReconcile(t *testing.T) {
	d, _ := newTestDriver(t)
	fake := &fakeSource{adoptState: json.RawMessage(`{"device":"/dev/loop9"}`)}
	d.sources["fake"] = fake
	staged := func(id string, phase model.Phase) *model.Volume {
		return &model.Volume{ID: id, Kind: model.KindProvisioned, Type: "fake",
			Stage: &model.Stage{Phase: phase, StagingPath: "/s", Source: json.RawMessage(`{"device":"/dev/loop1"}`)}}
	}
	interrupted := staged("interrupted", model.PhaseStaging)
	interruptedStatic := staged("static-interrupted", model.PhaseUnstaging)
	interruptedStatic.Kind = model.KindStatic
	healthy := staged("healthy", model.PhaseStaged)
	healthy.Consumers = []model.Claim{{Consumer: plan.Consumer{PID: deadPID(t), Namespace: plan.Namespace{Inode: 1}, MountPoint: "/gone"}}}
	healthy.Publishes = []model.Publish{{TargetPath: d.kubelet.root + "/not-mounted"}}
	halfMadeInline := &model.Volume{ID: "inline", Kind: model.KindEphemeral, Type: "fake", Creating: true}
	idle := &model.Volume{ID: "idle", Kind: model.KindProvisioned, Type: "fake"}
	for _, v := range []*model.Volume{interrupted, interruptedStatic, healthy, halfMadeInline, idle} {
		if err := d.records.Put(v, journal.Runtime); err != nil {
			t.Fatal(err)
		}
	}
	if d.Ready() {
		t.Fatal("ready before the startup reconcile")
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if !d.Ready() {
		t.Fatal("not ready after the startup reconcile")
	}

	if v, err := d.records.Get("interrupted"); err != nil || v.Stage != nil {
		t.Errorf("interrupted stage not undone: %+v %v", v, err)
	}
	if _, err := d.records.Get("static-interrupted"); err == nil {
		t.Error("an interrupted static volume's record survived")
	}
	if len(fake.unstaged) < 2 {
		t.Errorf("interrupted steps were not undone through the source: %v", fake.unstaged)
	}
	v, err := d.records.Get("healthy")
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Consumers) != 0 {
		t.Errorf("consumer whose namespace is gone was kept: %+v", v.Consumers)
	}
	if len(v.Publishes) != 0 {
		t.Errorf("publish that is no longer mounted was kept: %+v", v.Publishes)
	}
	if string(v.Stage.Source) != `{"device":"/dev/loop9"}` {
		t.Errorf("adopted state not recorded: %s", v.Stage.Source)
	}
	if _, err := d.records.Get("inline"); err == nil {
		t.Error("half-made inline volume survived")
	}
	if v, err := d.records.Get("idle"); err != nil || v.Stage != nil {
		t.Errorf("idle volume changed: %+v %v", v, err)
	}
	adoptedHealthy := false
	for _, id := range fake.adopted {
		if id == "healthy" {
			adoptedHealthy = true
		}
		if id == "idle" {
			t.Error("an unstaged volume was adopted")
		}
	}
	if !adoptedHealthy {
		t.Errorf("staged volume not adopted: %v", fake.adopted)
	}
}

func TestUnstageRefusesLiveConsumers(t *testing.T) {
	d, _ := newTestDriver(t)
	d.sources["fake"] = &fakeSource{}
	pid, ns := liveProcess(t)
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Type: "fake",
		Stage:     &model.Stage{Phase: model.PhaseStaged, Source: json.RawMessage(`{}`)},
		Consumers: []model.Claim{{Consumer: plan.Consumer{PID: pid, Namespace: ns, MountPoint: "/data"}}}}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	err := d.unstage(context.Background(), v)
	if err == nil {
		t.Fatal("unstage with a live consumer succeeded")
	}
	if want := fmt.Sprintf("pid %d", pid); !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not name the consumer (%s)", err, want)
	}
}

// reattachVolume records a staged volume with a live consumer, a dead one
// and a publish, all of one FUSE-like bind plan.
func reattachVolume(t *testing.T, d *Driver) int {
	t.Helper()
	d.sources["fake"] = &fakeSource{}
	pid, ns := liveProcess(t)
	mounts := []plan.Mount{{Type: plan.TypeBind, Source: "/var/lib/mountplan/fuse/v/mnt", Options: []string{"nosuid", "nodev"}}}
	v := &model.Volume{ID: "v", Kind: model.KindStatic, Type: "fake",
		Stage: &model.Stage{Phase: model.PhaseStaged, Source: json.RawMessage(`{}`)},
		Consumers: []model.Claim{
			{Consumer: plan.Consumer{PID: pid, Namespace: ns, MountPoint: "/data"}, Mounts: mounts},
			{Consumer: plan.Consumer{PID: deadPID(t), Namespace: plan.Namespace{Inode: 7}, MountPoint: "/gone"}, Mounts: mounts}},
		Publishes: []model.Publish{{TargetPath: "/var/lib/kubelet/pods/p/volumes/v/mount", Mounts: mounts}}}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	return pid
}

// A mounter that cannot heal: the recorded places are replaced (unmount,
// then mount), and the dead consumer is dropped.
func TestReattachReplacesEveryMount(t *testing.T) {
	d, m := newTestDriver(t)
	pid := reattachVolume(t, d)
	if _, err := d.Reattach(context.Background(), "v", plan.Heal{Dead: []uint64{42}, Source: "/var/lib/mountplan/fuse/v/mnt"}); err != nil {
		t.Fatal(err)
	}
	if m.calls != 4 { // unmount + mount at the live consumer and at the publish
		t.Fatalf("mounter calls = %d, want 4", m.calls)
	}
	got, err := d.records.Get("v")
	if err != nil || len(got.Consumers) != 1 || got.Consumers[0].PID != pid {
		t.Fatalf("dead consumer not dropped: %+v %v", got, err)
	}
}

// healingMounter heals as a sidecar would and counts what it is asked.
type healingMounter struct {
	mounts, unmounts int
	heals            []plan.Heal
	left             []plan.StaleMount
	err              error
}

func (m *healingMounter) Mount(context.Context, []plan.Mount, plan.Consumer) error {
	m.mounts++
	return nil
}

func (m *healingMounter) Unmount(context.Context, []plan.Mount, plan.Consumer) error {
	m.unmounts++
	return nil
}

func (m *healingMounter) HealFuse(_ context.Context, h plan.Heal) (plan.HealResult, error) {
	m.heals = append(m.heals, h)
	return plan.HealResult{Left: m.left}, m.err
}

// A mounter that heals: the dead connections are replaced everywhere
// first, then the plan is performed again (never unmounted: no moment
// without the volume) at the live consumer and the publish; what the heal
// left is passed on; a failed heal re-attaches nothing.
func TestReattachHealsFirst(t *testing.T) {
	heal := plan.Heal{Dead: []uint64{42, 43}, Source: "/var/lib/mountplan/fuse/v/mnt"}
	left := []plan.StaleMount{{PID: 9, MountPoint: "/x", Conn: 42, Reason: "covered"}}
	for _, tc := range []struct {
		name                   string
		m                      *healingMounter
		wantMounts, wantUnmnts int
		wantLeft               int
		wantErr                bool
	}{
		{name: "healed", m: &healingMounter{}, wantMounts: 2},
		{name: "left", m: &healingMounter{left: left}, wantMounts: 2, wantLeft: 1},
		{name: "heal failed", m: &healingMounter{err: errdefs.ErrUnavailable}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "node-a", StateDir: t.TempDir(), KubeletDir: t.TempDir(), Mounter: tc.m}))
			if err != nil {
				t.Fatal(err)
			}
			reattachVolume(t, d)
			res, err := d.Reattach(context.Background(), "v", heal)
			if (err != nil) != tc.wantErr {
				t.Fatalf("Reattach: %v, want error %t", err, tc.wantErr)
			}
			if len(tc.m.heals) != 1 || !slices.Equal(tc.m.heals[0].Dead, heal.Dead) || tc.m.heals[0].Source != heal.Source {
				t.Errorf("heals asked: %+v, want one of %+v", tc.m.heals, heal)
			}
			if tc.m.mounts != tc.wantMounts || tc.m.unmounts != tc.wantUnmnts {
				t.Errorf("mounts %d, unmounts %d; want %d, %d", tc.m.mounts, tc.m.unmounts, tc.wantMounts, tc.wantUnmnts)
			}
			if len(res.Left) != tc.wantLeft {
				t.Errorf("left %+v, want %d", res.Left, tc.wantLeft)
			}
		})
	}
}

// TestReconcileRemovesInterruptedWrites: the temp files that a crash left
// behind a record write or an image creation go at the next reconcile,
// whether the volume has a record or not, except those of a volume whose
// lock a request holds (its write may be under way).
func TestReconcileRemovesInterruptedWrites(t *testing.T) {
	d, _ := newTestDriver(t)
	d.sources["fake"] = &fakeSource{}
	if err := d.records.Put(&model.Volume{ID: "rec", Kind: model.KindProvisioned, Type: "fake"}, journal.Durable); err != nil {
		t.Fatal(err)
	}
	vols := filepath.Join(d.opts.StateDir, "volumes")
	prov := filepath.Join(d.opts.StateDir, "images", "provisioned")
	eph := filepath.Join(d.opts.StateDir, "images", "ephemeral")
	scratch := filepath.Join(d.opts.StateDir, "images", "scratch")
	gone := []string{
		filepath.Join(vols, ".rec.json.tmp-123"), filepath.Join(vols, ".rec.json.durable.tmp-4"),
		filepath.Join(vols, ".norecord.json.tmp-5"), filepath.Join(prov, ".rec.img.tmp-6"),
		filepath.Join(eph, ".norecord.img.tmp-7"), filepath.Join(scratch, ".rec.img.tmp-8"),
	}
	kept := []string{
		filepath.Join(vols, ".busy.json.tmp-9"), filepath.Join(prov, ".busy.img.tmp-10"), // a request holds the lock
		filepath.Join(vols, "rec.json"), filepath.Join(vols, "rec.json.durable"),
		filepath.Join(prov, ".rec.img.tmp-x"), filepath.Join(prov, "notatemp.img"), // not CreateAtomic's names
	}
	for _, p := range append(gone, kept...) {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(p); err != nil {
			if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	unlock, err := d.records.TryLock("busy", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	unlock()
	for _, p := range gone {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s is still there after reconcile: %v", p, err)
		}
	}
	for _, p := range kept {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s was removed: %v", p, err)
		}
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, p := range kept[:2] {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s is still there after the reconcile that found its volume free: %v", p, err)
		}
	}
}

// TestReadersNeverSeeATornRecord: a runtime write rewrites the record file
// in place; a reader that looked at the file during such a write would see
// half a record and fall back to the older durable copy (here: not
// staged). Readers get the last committed record instead, whatever the
// file holds at that moment.
func TestReadersNeverSeeATornRecord(t *testing.T) {
	d, _ := newTestDriver(t)
	d.sources["fake"] = &fakeSource{}
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Type: "fake"}
	if err := d.records.Put(v, journal.Durable); err != nil {
		t.Fatal(err)
	}
	v.Stage = &model.Stage{Phase: model.PhaseStaged, StagingPath: "/s", Source: json.RawMessage(`{}`)}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	// What a reader of the file sees in the middle of the next in-place write.
	file := filepath.Join(d.opts.StateDir, "volumes", "v.json")
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, b[:len(b)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := d.records.Get("v")
	if err != nil || !got.Staged() {
		t.Fatalf("record while its file is half written: %+v, %v; want the staged record", got, err)
	}
	if n := d.StagedByType()["fake"]; n != 1 {
		t.Fatalf("staged gauge %d while the file is half written, want 1", n)
	}
}

// TestReconcileKeepsInlineKubeletHas: an inline volume whose publish shows
// no mount (the node rebooted, long after the pod started) stays, with its
// publish, while kubelet keeps the pod's volume directory: kubelet will
// publish it again. Once that directory is gone, so is the volume.
func TestReconcileKeepsInlineKubeletHas(t *testing.T) {
	d, _ := newTestDriver(t)
	fake := &fakeSource{}
	d.sources["fake"] = fake
	volDir := filepath.Join(d.kubelet.root, "pods", "uid", "volumes", "kubernetes.io~csi", "scratch")
	if err := os.MkdirAll(volDir, 0o750); err != nil {
		t.Fatal(err)
	}
	v := &model.Volume{ID: "inline", Kind: model.KindEphemeral, Type: "fake",
		Stage:     &model.Stage{Phase: model.PhaseStaged, StagingPath: "/s", Source: json.RawMessage(`{}`)},
		Publishes: []model.Publish{{TargetPath: filepath.Join(volDir, "mount")}}} // asked long ago
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, err := d.records.Get("inline"); err != nil || len(got.Publishes) != 1 {
		t.Fatalf("inline volume while kubelet keeps its directory: %+v, %v; want it with its publish", got, err)
	}
	if slices.Contains(fake.unstaged, "inline") {
		t.Fatal("inline volume unstaged while kubelet keeps its directory")
	}
	if err := os.Remove(volDir); err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := d.records.Get("inline"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("inline volume after kubelet removed its directory: %v, want NotFound", err)
	}
	if !slices.Contains(fake.unstaged, "inline") {
		t.Errorf("inline volume removed without an unstage: %v", fake.unstaged)
	}
}
