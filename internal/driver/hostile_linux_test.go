package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/test/testutil"
)

// hostileEnv is a driver with the in-process executor over a kubelet dir
// of its own, a staged 16 MiB ext4 volume, and a directory outside the
// kubelet dir that stands for the host's files.
type hostileEnv struct {
	d                *Driver
	kubelet, outside string
	staging          string // where "vol" is staged
	parent           string // a pod's volume dir under the kubelet dir
	victim           string // a file outside the kubelet dir
	link             string // a symlink under the kubelet dir to outside
}

const mib = 1 << 20

func newHostileEnv(t *testing.T) *hostileEnv {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	testutil.NoLeaks(t)
	base := t.TempDir()
	e := &hostileEnv{kubelet: filepath.Join(base, "kubelet"), outside: filepath.Join(base, "outside")}
	e.staging = filepath.Join(e.kubelet, "plugins/kubernetes.io/csi/mountplan.csi.io/vol/globalmount")
	e.parent = filepath.Join(e.kubelet, "pods/uid-1/volumes/kubernetes.io~csi/pv-1")
	e.victim = filepath.Join(e.outside, "victim")
	e.link = filepath.Join(e.kubelet, "pods/evil")
	for _, dir := range []string{e.parent, e.outside, filepath.Dir(e.staging)} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(e.victim, []byte("host file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(e.outside, e.link); err != nil {
		t.Fatal(err)
	}
	cfg := &config.Config{DefaultFsType: "ext4"}
	state := filepath.Join(base, "state")
	d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "n", StateDir: state, KubeletDir: e.kubelet, Config: cfg}))
	if err != nil {
		t.Fatal(err)
	}
	e.d = d
	ctx := context.Background()
	for _, id := range []string{"vol", "vol2"} {
		if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: id, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "vol", StagingTargetPath: e.staging, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.teardown(t) })
	return e
}

// teardown unpublishes, unstages and deletes whatever the rows left, also
// what a refused request should never have made (a red run).
func (e *hostileEnv) teardown(t *testing.T) {
	ctx := context.Background()
	vols, _ := e.d.records.List()
	for _, v := range vols {
		for _, p := range v.Publishes {
			if err := e.d.unpublish(ctx, v, p.TargetPath); err != nil {
				t.Errorf("cleanup: unpublish %s at %s: %v", v.ID, p.TargetPath, err)
			}
		}
		if v.Stage != nil {
			if err := e.d.unstage(ctx, v); err != nil {
				t.Errorf("cleanup: unstage %s: %v", v.ID, err)
			}
		}
		if _, err := e.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.ID}); err != nil {
			t.Errorf("cleanup: delete %s: %v", v.ID, err)
		}
	}
}

func (e *hostileEnv) publish(volumeID, staging, target string, flags ...string) error {
	c := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	c.GetMount().MountFlags = flags
	_, err := e.d.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: volumeID,
		StagingTargetPath: staging, TargetPath: target, VolumeCapability: c})
	return err
}

func (e *hostileEnv) unpublish(volumeID, target string) error {
	_, err := e.d.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: volumeID, TargetPath: target})
	return err
}

func (e *hostileEnv) stage(volumeID, staging string) error {
	_, err := e.d.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{VolumeId: volumeID,
		StagingTargetPath: staging, VolumeCapability: rwo})
	return err
}

// untouched fails unless p is still the host file it was.
func untouched(p string) error {
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "host file\n" {
		return fmt.Errorf("%s was changed or removed: %q, %v", p, b, err)
	}
	return nil
}

// notMounted fails if anything is mounted at p.
func notMounted(p string) error {
	if m, err := mountinfo.Mounted(p); err == nil && m {
		return fmt.Errorf("%s was mounted over", p)
	}
	return nil
}

// TestHostileRequests sends each hostile request of issue 11 (items 3, 4,
// 7) and a few of their cousins, as a table of requests and the code each
// must get, then checks that nothing outside the kubelet dir was touched.
// Rows run in order; the row aimed at the real /etc is sent only when
// every earlier row that could mount over a host path was refused, so a
// broken build never hides this machine's /etc.
func TestHostileRequests(t *testing.T) {
	e := newHostileEnv(t)
	ctx := context.Background()
	file := filepath.Join(e.parent, "file") // an existing file under the kubelet dir nobody published
	if err := os.WriteFile(file, []byte("host file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	outsideTarget := filepath.Join(e.outside, "target")
	rows := []struct {
		name  string
		call  func() error
		want  codes.Code
		after func() error // what must hold afterwards
		// risky: only sent while no earlier row mounted over a host path
		risky bool
	}{
		{"publish at a target outside the kubelet dir", func() error { return e.publish("vol", e.staging, outsideTarget) },
			codes.InvalidArgument, func() error { return notMounted(outsideTarget) }, false},
		{"publish through a symlinked parent", func() error { return e.publish("vol", e.staging, filepath.Join(e.link, "mount")) },
			codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.outside, "mount")) }, false},
		{"publish at /etc", func() error { return e.publish("vol", e.staging, "/etc") },
			codes.InvalidArgument, func() error { return notMounted("/etc") }, true},
		{"publish with a staging path other than the staged one", func() error {
			return e.publish("vol", filepath.Join(e.kubelet, "plugins/other/globalmount"), filepath.Join(e.parent, "mount"))
		}, codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.parent, "mount")) }, false},
		{"publish with a staging path through a symlinked parent", func() error {
			return e.publish("vol", filepath.Join(e.link, "globalmount"), filepath.Join(e.parent, "mount"))
		}, codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.parent, "mount")) }, false},
		{"publish with mount option errors=panic", func() error { return e.publish("vol", e.staging, filepath.Join(e.parent, "mount"), "errors=panic") },
			codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.parent, "mount")) }, false},
		{"publish with mount option noload", func() error { return e.publish("vol", e.staging, filepath.Join(e.parent, "mount"), "noload") },
			codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.parent, "mount")) }, false},
		{"publish with mount option dax=always", func() error { return e.publish("vol", e.staging, filepath.Join(e.parent, "mount"), "dax=always") },
			codes.InvalidArgument, func() error { return notMounted(filepath.Join(e.parent, "mount")) }, false},
		{"stage at a staging path outside the kubelet dir", func() error { return e.stage("vol2", filepath.Join(e.outside, "stage")) },
			codes.InvalidArgument, nil, false},
		{"stage through a symlinked parent", func() error { return e.stage("vol2", filepath.Join(e.link, "globalmount")) },
			codes.InvalidArgument, nil, false},
		{"stage at the kubelet dir's parent by dot-dot", func() error { return e.stage("vol2", e.kubelet+"/../stage") },
			codes.InvalidArgument, nil, false},
		{"unpublish of an unknown volume at an existing file", func() error { return e.unpublish("nothing", file) },
			codes.OK, func() error { return untouched(file) }, false},
		{"unpublish of a staged volume at a file it never published", func() error { return e.unpublish("vol", file) },
			codes.OK, func() error { return untouched(file) }, false},
		{"unpublish of an unknown volume at a file outside the kubelet dir", func() error { return e.unpublish("nothing", e.victim) },
			codes.InvalidArgument, func() error { return untouched(e.victim) }, false},
		{"unpublish through a symlinked parent", func() error { return e.unpublish("nothing", filepath.Join(e.link, "victim")) },
			codes.InvalidArgument, func() error { return untouched(e.victim) }, false},
		{"create of 1 EiB", func() error {
			_, err := e.d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "huge", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 60}})
			return err
		}, codes.OutOfRange, func() error {
			if _, err := e.d.records.Get("huge"); !errors.Is(err, errdefs.ErrNotFound) {
				return fmt.Errorf("the refused create left a record: %v", err)
			}
			return nil
		}, false},
		{"create of the same name at 16 MiB afterwards", func() error {
			_, err := e.d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "huge", VolumeCapabilities: []*csi.VolumeCapability{rwo},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
			return err
		}, codes.OK, nil, false},
		{"controller expand to 1 EiB", func() error {
			_, err := e.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "vol2",
				CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 60}})
			return err
		}, codes.OutOfRange, func() error {
			if v, err := e.d.records.Get("vol2"); err != nil || v.CapacityBytes != 16*mib {
				return fmt.Errorf("the refused expansion changed the record: %+v %v", v, err)
			}
			return nil
		}, false},
		{"node expand at a path where the volume is not", func() error {
			_, err := e.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: filepath.Join(e.parent, "elsewhere")})
			return err
		}, codes.NotFound, nil, false},
		{"node expand beyond what the device holds", func() error {
			_, err := e.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: e.staging,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 40}})
			return err
		}, codes.OutOfRange, nil, false},
		{"node expand with limit below the volume's size", func() error {
			_, err := e.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: e.staging,
				CapacityRange: &csi.CapacityRange{LimitBytes: 8 * mib}})
			return err
		}, codes.OutOfRange, nil, false},
		{"node expand at the staging path within range", func() error {
			_, err := e.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "vol", VolumePath: e.staging,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
			return err
		}, codes.OK, nil, false},
	}
	safe := true
	for _, r := range rows {
		if r.risky && !safe {
			t.Errorf("%s: not sent, an earlier row mounted over a host path", r.name)
			continue
		}
		ok := t.Run(r.name, func(t *testing.T) {
			if got := errdefs.Code(r.call()); got != r.want {
				t.Errorf("code %v, want %v", got, r.want)
			}
			if r.after != nil {
				if err := r.after(); err != nil {
					t.Error(err)
				}
			}
			if err := untouched(e.victim); err != nil {
				t.Error(err)
			}
		})
		safe = safe && ok
	}
	if v, err := e.d.records.Get("vol2"); err != nil || v.Stage != nil {
		t.Errorf("a refused stage left vol2 staged: %+v %v", v, err)
	}
}

// TestPublishCreatesAndRemovesOnlyItsOwnTarget: a publish at a missing
// target creates it and its unpublish removes it; a target kubelet made
// (an existing directory) is used and left; an unpublish after the record
// is gone touches nothing.
func TestPublishCreatesAndRemovesOnlyItsOwnTarget(t *testing.T) {
	e := newHostileEnv(t)
	made := filepath.Join(e.parent, "mount")
	if err := e.publish("vol", e.staging, made); err != nil {
		t.Fatal(err)
	}
	if err := e.publish("vol", e.staging, made); err != nil {
		t.Fatalf("repeated publish: %v", err)
	}
	if err := e.unpublish("vol", made); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(made); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the target the publish created is still there: %v", err)
	}
	existing := filepath.Join(e.kubelet, "pods/uid-2/volumes/kubernetes.io~csi/pv-2/mount")
	if err := os.MkdirAll(existing, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := e.publish("vol", e.staging, existing); err != nil {
		t.Fatal(err)
	}
	if err := e.unpublish("vol", existing); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(existing); err != nil || !fi.IsDir() {
		t.Errorf("unpublish removed a target it did not create: %v", err)
	}
	if err := notMounted(existing); err != nil {
		t.Error(err)
	}
	if err := e.unpublish("vol", existing); err != nil {
		t.Fatalf("repeated unpublish: %v", err)
	}
	if _, err := os.Lstat(existing); err != nil {
		t.Errorf("repeated unpublish touched the target: %v", err)
	}
}

// TestPrepareConsumerPermissionDenied: a consumer whose mount namespace the
// plugin may not open (EACCES) is PermissionDenied, not Internal. The
// plugin runs as root, so the check runs in a copy of this test binary as
// an unprivileged user, against PID 1.
func TestPrepareConsumerPermissionDenied(t *testing.T) {
	if os.Getenv("MOUNTPLAN_EACCES_HELPER") == "1" {
		prepareAsUnprivileged()
		return
	}
	testutil.RequireRoot(t)
	dir, err := os.MkdirTemp("", "mp-eacces-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "driver.test")
	if err := testutil.CopyFile(self, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^TestPrepareConsumerPermissionDenied$", "-test.count=1")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "MOUNTPLAN_EACCES_HELPER=1", "MOUNTPLAN_EACCES_DIR="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); !strings.Contains(got, "code=PermissionDenied") {
		t.Fatalf("prepare for a consumer whose namespace cannot be opened: %s, want code=PermissionDenied", got)
	}
}

// prepareAsUnprivileged runs in the helper: a staged record, then a
// prepare for PID 1, whose namespace an unprivileged user may not open.
func prepareAsUnprivileged() {
	dir := os.Getenv("MOUNTPLAN_EACCES_DIR")
	kubelet := filepath.Join(dir, "kubelet")
	staging := filepath.Join(kubelet, "staging")
	opts, err := loopOptions(Options{DriverName: "mountplan.csi.io", NodeID: "n", StateDir: filepath.Join(dir, "state"), KubeletDir: kubelet, Mounter: &recordingMounter{}})
	if err != nil {
		fmt.Println("New:", err)
		return
	}
	d, err := New(opts)
	if err != nil {
		fmt.Println("New:", err)
		return
	}
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Type: "loop",
		Stage: &model.Stage{Phase: model.PhaseStaged, StagingPath: staging, Source: []byte(`{}`)}}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		fmt.Println("Put:", err)
		return
	}
	_, err = d.NodePrepareVolume(context.Background(), &api.NodePrepareVolumeRequest{VolumeId: "v", StagingTargetPath: staging,
		VolumeCapability: rwo, Consumer: &api.Consumer{Pid: 1, MountPoint: "/data"}})
	fmt.Printf("code=%v err=%v\n", errdefs.Code(err), err)
}
