package e2e

// kubelet's flow with the mounter split out: the plugin runs with
// --mounter-endpoint and hands NodePublishVolume's plan to a long-running
// `mountplan-sidecar serve`, which performs it at the target path in the
// host namespace.

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestPublishThroughSidecarServe(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	tm := prepTimer(t)
	e := newEnv(t, "")
	srv := e.startMounter("")
	e.startPlugin("")
	if fi, err := os.Stat(srv.socket); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("mounter socket %s: %v, %v; want mode 0600", srv.socket, fi, err)
	}
	tm.step("plugin and mountplan-sidecar serve running")

	id := e.create("prep-serve", "", 32*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)

	if err := os.Mkdir(filepath.Join(e.dir, "pod"), 0o750); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e.dir, "pod", "mount")
	publish := func() error {
		_, err := e.node.NodePublishVolume(e.ctx(), &csi.NodePublishVolumeRequest{VolumeId: id,
			StagingTargetPath: e.staging(id), TargetPath: target, VolumeCapability: mountCap("", rwo)})
		return err
	}
	unpublish := func() error {
		_, err := e.node.NodeUnpublishVolume(e.ctx(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		return err
	}
	if err := publish(); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	mi := prepHostMountAt(t, target)
	if mi == nil || mi.FSType != "ext4" || uint32(mi.Major) != dev.Major || uint32(mi.Minor) != dev.Minor {
		t.Fatalf("host mount at %s: %+v; want ext4 on %s", target, mi, dev)
	}
	for _, o := range []string{"nosuid", "nodev"} {
		if !strings.Contains(","+mi.Options+",", ","+o+",") {
			t.Errorf("published mount lacks %s: %s", o, mi.Options)
		}
	}
	// The sidecar performed it, not the plugin.
	if l := srv.log(); !strings.Contains(l, `method="Mount"`) || !strings.Contains(l, "Call succeeded") {
		t.Errorf("the sidecar's log shows no Mount call:\n%s", l)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("published\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(target, "f")); err != nil || string(b) != "published\n" {
		t.Errorf("reading back: %q, %v", b, err)
	}
	if v := e.mustRecord(id); len(v.Publishes) != 1 || v.Publishes[0].TargetPath != target {
		t.Errorf("journal publishes %+v, want %s", v.Publishes, target)
	}
	if err := publish(); err != nil {
		t.Errorf("repeated NodePublishVolume: %v", err)
	}
	if n := len(prepHostMountsOfDev(t, dev)); n != 1 {
		t.Errorf("after a repeated publish %s is mounted %d times on the host, want 1", dev, n)
	}
	tm.step("published through the sidecar")

	if err := unpublish(); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("target %s left after NodeUnpublishVolume: %v", target, err)
	}
	prepCheckHostClean(t, "after NodeUnpublishVolume", dev)
	if strings.Count(srv.log(), `method="Unmount"`) == 0 {
		t.Errorf("the sidecar's log shows no Unmount call:\n%s", srv.log())
	}
	if err := unpublish(); err != nil {
		t.Errorf("repeated NodeUnpublishVolume: %v", err)
	}
	if v := e.mustRecord(id); len(v.Publishes) != 0 {
		t.Errorf("journal publishes after unpublish: %+v", v.Publishes)
	}
	tm.step("unpublished")

	if code := srv.stop(t); code != 0 {
		t.Errorf("mountplan-sidecar serve exited %d on SIGTERM, want 0:\n%s", code, srv.log())
	}
	if _, err := os.Lstat(srv.socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mounter socket left after SIGTERM: %v", err)
	}
	// With the mounter gone, a publish fails cleanly and records nothing.
	err := publish()
	testutil.WantCode(t, "NodePublishVolume with the mounter stopped", err, codes.Unavailable)
	if mi := prepHostMountAt(t, target); mi != nil {
		t.Errorf("something is mounted at %s: %s", target, mi.FSType)
	}
	if v := e.mustRecord(id); len(v.Publishes) != 0 {
		t.Errorf("journal publishes after a failed publish: %+v", v.Publishes)
	}
	tm.step("sidecar stopped with SIGTERM; publish without it fails")

	// The volume's loop device is the mounter's: a new mounter takes it
	// back (attached again at the same number), and the unstage detaches it.
	e.startMounter("")
	e.unstage(id)
	waitNoLoop(t, image)
	e.delete(id)
}
