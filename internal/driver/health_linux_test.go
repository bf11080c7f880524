package driver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/loop"
)

// TestLoopHealthWhenBroken stages real loop volumes, breaks each behind
// the plugin's back and asks NodeGetVolumeHealth, as kubelet does, and
// ControllerGetVolumeHealth, which says the same of a volume staged on
// its node (ControllerListVolumeHealth lists only the broken one): a
// device the kernel detached (the mounter let go of it, as a mounter that
// died does) is INACCESSIBLE with DeviceGone until a repeated stage
// attaches it again; an image removed under a staged volume is DATA_LOSS
// with ImageGone. Unstage and delete still work, and nothing
// is left (NoLeaks).
func TestLoopHealthWhenBroken(t *testing.T) {
	d, kubelet := newRootDriver(t)
	ctx := context.Background()
	staging := func(id string) string { return filepath.Join(kubelet, "plugins/mountplan", id, "globalmount") }
	for _, id := range []string{"detached", "unlinked"} {
		if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: id, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging(id)}); err != nil {
				t.Errorf("unstage %s: %v", id, err)
			}
			if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		})
		if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging(id), VolumeCapability: rwo}); err != nil {
			t.Fatal(err)
		}
		if err := wantHealth(d, id, 0, ""); err != nil {
			t.Fatalf("freshly staged: %v", err)
		}
	}

	t.Run("device detached", func(t *testing.T) {
		dev := loopStateOf(t, d, "detached").Device
		other := loopStateOf(t, d, "unlinked")
		if n, err := d.opts.Node.KeepLoops(ctx, []loopdev.Identity{other.Identity}, time.Now().Add(time.Hour)); err != nil || n != 1 {
			t.Fatalf("the mounter let go of %d devices (%v), want 1", n, err)
		}
		waitUnbound(t, dev)
		if err := wantHealth(d, "detached", csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceGone"); err != nil {
			t.Fatal(err)
		}
		// kubelet's repeated stage adopts: the image is attached again.
		if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "detached", StagingTargetPath: staging("detached"), VolumeCapability: rwo}); err != nil {
			t.Fatal(err)
		}
		if err := wantHealth(d, "detached", 0, ""); err != nil {
			t.Fatalf("after the repeated stage: %v", err)
		}
	})
	t.Run("image removed", func(t *testing.T) {
		v, err := d.records.Get("unlinked")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(v.Image); err != nil {
			t.Fatal(err)
		}
		if err := wantHealth(d, "unlinked", csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone"); err != nil {
			t.Fatal(err)
		}
		if err := wantHealth(d, "detached", 0, ""); err != nil {
			t.Fatalf("the other volume: %v", err)
		}
		list, err := d.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if e := list.GetEntries(); len(e) != 1 || e[0].GetVolumeId() != "unlinked" {
			t.Fatalf("ControllerListVolumeHealth listed %v, want unlinked alone", e)
		}
	})
}

// wantHealth asks NodeGetVolumeHealth and ControllerGetVolumeHealth about
// id (a provisioned volume staged here, so both give the same answer, the
// controller's image check and the node's merged): no status when reason
// is empty, else one status of that type with that reason and a message.
func wantHealth(d *Driver, id string, status csi.VolumeHealthErrorType, reason string) error {
	ctx := context.Background()
	node, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		return err
	}
	ctrl, err := d.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		return err
	}
	for _, h := range []struct {
		rpc string
		h   *csi.VolumeHealth
	}{{"node", node.GetVolumeHealth()}, {"controller", ctrl.GetVolumeHealth()}} {
		got := h.h.GetHealthStatuses()
		if h.h.GetVolumeId() != id {
			return fmt.Errorf("%s health of %q answered for %q", h.rpc, id, h.h.GetVolumeId())
		}
		switch {
		case reason == "" && len(got) != 0:
			return fmt.Errorf("%s: %s says %v, want healthy", id, h.rpc, got)
		case reason == "":
		case len(got) != 1 || got[0].GetStatus() != status || got[0].GetReason() != reason || got[0].GetMessage() == "":
			return fmt.Errorf("%s: %s says %v, want %s %s with a message", id, h.rpc, got, status, reason)
		}
	}
	return nil
}

// loopStateOf returns what the record of staged loop volume id holds.
func loopStateOf(t *testing.T, d *Driver, id string) loop.State {
	t.Helper()
	v, err := d.records.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	st, err := source.DecodeState[loop.State](viewOf(v))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(st.Device, "/dev/loop") {
		t.Fatalf("volume %s staged on %q", id, st.Device)
	}
	return st
}

// waitUnbound waits until the kernel shows dev unbound (no loop/ in sysfs):
// autoclear detaches it once its last opener is gone.
func waitUnbound(t *testing.T, dev string) {
	t.Helper()
	sys := filepath.Join("/sys/block", filepath.Base(dev), "loop")
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sys); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still bound 10s after the mounter let go of it", dev)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
