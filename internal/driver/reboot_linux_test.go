package driver

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestRebootOnRealLoopDevices: a volume staged and published on a real
// loop device, with data written; the node "reboots" (the mount and the
// device are gone as after a power loss, and the mounter's records are of
// another boot), and another image takes the loop number the records
// name. The plugin started in the new boot touches neither that device
// nor the old number: kubelet's stage attaches the volume's own image
// afresh, its publish shows the data, and the other image's device is
// still its own. Nothing is left (NoLeaks).
func TestRebootOnRealLoopDevices(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	testutil.NoLeaks(t)
	base := t.TempDir()
	kubelet, state := filepath.Join(base, "kubelet"), filepath.Join(base, "state")
	ctx := context.Background()
	const id = "rebooted"
	staging := filepath.Join(kubelet, "plugins/mountplan", id, "globalmount")
	target := filepath.Join(kubelet, "pods/p/volumes/v/mount")
	start := func(boot string) (*Driver, *mounter.Local) {
		t.Helper()
		d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "n", StateDir: state, KubeletDir: kubelet,
			Config: &config.Config{DefaultFsType: "ext4"}, BootID: func() (string, error) { return boot, nil }}))
		if err != nil {
			t.Fatal(err)
		}
		return d, d.node.(*mounter.Local)
	}

	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		t.Fatal(err)
	}
	image := loop.New(state, nil).ImagePath("provisioned", id)
	// Whatever a failure leaves of boot A's stage, before the leak check.
	t.Cleanup(func() {
		_ = unix.Unmount(target, unix.MNT_DETACH)
		found, _ := loopdev.FindByBacking(image)
		for _, d := range found {
			_ = d.Detach()
		}
	})

	// Boot A: staged, published, data written and synced.
	a, nodeA := start("boot-a")
	if _, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: id, VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	data := []byte("written before the reboot\n")
	writeSynced(t, filepath.Join(target, "data"), data)
	old := loopStateOf(t, a, id)

	// The power goes: the kernel drops the mount and, with the last
	// holder gone, the device; the mounter's records are of an ended boot.
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := nodeA.Close(); err != nil {
		t.Fatal(err)
	}
	waitDetached(t, image)
	testutil.EndMounterBoot(t, mounter.DefaultRecordsDir(state))
	// Another image gets the number the records name.
	decoyImage := filepath.Join(base, "decoy.img")
	if err := os.WriteFile(decoyImage, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	decoy := attachAt(t, decoyImage, old.Device)
	t.Cleanup(func() {
		if err := decoy.Detach(); err != nil {
			t.Errorf("detach the decoy: %v", err)
		}
	})

	// Boot B.
	b, nodeB := start("boot-b")
	t.Cleanup(func() { _ = nodeB.Close() })
	if b.RebootedFrom() != "boot-a" {
		t.Fatalf("the reboot went unseen (from %q)", b.RebootedFrom())
	}
	if err := b.Reconcile(ctx); err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if found, err := loopdev.FindByBacking(image); err != nil || len(found) != 0 {
		t.Fatalf("before kubelet asks, the image is attached again (%v, %v): the plugin did not wait for the stage", found, err)
	}
	checkDecoy(t, decoy, decoyImage)
	if _, err := b.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
		t.Fatalf("stage after the reboot: %v", err)
	}
	if _, err := b.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: rwo}); err != nil {
		t.Fatalf("publish after the reboot: %v", err)
	}
	t.Cleanup(func() {
		if _, err := b.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
			t.Errorf("unpublish: %v", err)
		}
		if _, err := b.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Errorf("unstage: %v", err)
		}
		if _, err := b.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("delete: %v", err)
		}
	})
	now := loopStateOf(t, b, id)
	if now.Device == old.Device {
		t.Errorf("the volume was staged on %s, the other image's device", now.Device)
	}
	if got, err := os.ReadFile(filepath.Join(target, "data")); err != nil || !bytes.Equal(got, data) {
		t.Errorf("data after the reboot = %q, %v; want %q", got, err, data)
	}
	checkDecoy(t, decoy, decoyImage)
	if v := get(t, b, id); v.Rebooted != nil || !v.Staged() || len(v.Publishes) != 1 {
		t.Errorf("record after the stage and publish: %+v", v)
	}
}

func writeSynced(t *testing.T, path string, data []byte) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// waitDetached waits for the kernel to clear the devices of image (a
// loop device with autoclear is cleared after its last close, not always
// at once).
func waitDetached(t *testing.T, image string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		found, err := loopdev.FindByBacking(image)
		if err != nil {
			t.Fatal(err)
		}
		if len(found) == 0 {
			return
		}
		for _, d := range found {
			_ = d.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still attached after its last holder closed it", image)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// attachAt attaches image to the loop device at path: devices are
// attached until one lands there (the kernel hands out the lowest free
// number), then the others are detached.
func attachAt(t *testing.T, image, path string) *loopdev.Device {
	t.Helper()
	var extra []*loopdev.Device
	defer func() {
		for _, d := range extra {
			if err := d.Detach(); err != nil {
				t.Errorf("detach %s: %v", d.Path, err)
			}
		}
	}()
	for range 64 {
		d, err := loopdev.Attach(context.Background(), image, loopdev.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if d.Path == path {
			return d
		}
		extra = append(extra, d)
	}
	t.Fatalf("%s did not come free for another image", path)
	return nil
}

// checkDecoy fails the test unless the other image's device is still
// attached to it.
func checkDecoy(t *testing.T, decoy *loopdev.Device, image string) {
	t.Helper()
	found, err := loopdev.FindByBacking(image)
	if err != nil || len(found) != 1 || found[0].Path != decoy.Path {
		t.Fatalf("the other image's device: %v, %v; want %s still its own", found, err, decoy.Path)
	}
	for _, d := range found {
		_ = d.Close()
	}
}
