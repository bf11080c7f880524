package driver

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/volview"
)

// TestVolumesAgainstTheKernel stages and publishes a real loop volume and
// reads /debug/volumes as the plugin serves it: the volume is staged on
// its loop device, healthy, and its kubelet target is present in the
// mount table. Unmounted behind the plugin's back, the target is absent
// and the listing says records and kernel disagree. Unpublish, unstage
// and delete still work, and nothing is left (NoLeaks).
func TestVolumesAgainstTheKernel(t *testing.T) {
	d, kubelet := newRootDriver(t)
	ctx := context.Background()
	const id = "listed"
	staging := filepath.Join(kubelet, "plugins/mountplan", id, "globalmount")
	target := filepath.Join(kubelet, "pods/p/volumes/v/mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: id, VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
			t.Errorf("unpublish: %v", err)
		}
		if _, err := d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Errorf("unstage: %v", err)
		}
		if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("delete: %v", err)
		}
	})
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	// kubelet's pod info (podInfoOnMount) names the pod in the listing.
	podInfo := map[string]string{ctxPodNamespace: "shop", ctxPodName: "web-0", ctxPodUID: "p"}
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: rwo, VolumeContext: podInfo}); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(volview.Handler(d.Volumes, volview.HostProc))
	defer srv.Close()

	v, table := listVolume(t, srv.URL, id)
	if v.Stage != "staged" || !strings.HasPrefix(v.Device, "/dev/loop") || v.Device != loopStateOf(t, d, id).Device ||
		!strings.HasPrefix(v.Source, "image ") || v.Health.Status != "ok" {
		t.Errorf("volume %+v\n%s", v, table)
	}
	if len(v.Consumers) != 1 || v.Consumers[0].Path != target || v.Consumers[0].Kernel.State != volview.Present || v.Consumers[0].Kernel.Disagrees {
		t.Fatalf("consumers %+v, want the target present\n%s", v.Consumers, table)
	}
	if p := v.Consumers[0].Pod; p == nil || *p != (volview.Pod{Namespace: "shop", Name: "web-0", UID: "p"}) || !strings.Contains(table, target+" in pod shop/web-0") {
		t.Errorf("consumer's pod %+v, want shop/web-0 (uid p) in JSON and table\n%s", p, table)
	}
	t.Logf("published:\n%s", table)

	if err := unix.Unmount(target, 0); err != nil {
		t.Fatalf("unmount %s behind the plugin's back: %v", target, err)
	}
	v, table = listVolume(t, srv.URL, id)
	if c := v.Consumers[0]; c.Kernel.State != volview.Absent || !c.Kernel.Disagrees || !strings.Contains(table, "DISAGREES") {
		t.Fatalf("after the unmount: %+v, want absent and disagreeing\n%s", c, table)
	}
	t.Logf("unmounted behind the plugin's back:\n%s", table)
}

// listVolume reads the listing at url/debug/volumes and returns volume id's
// entry and the whole listing as a table.
func listVolume(t *testing.T, url, id string) (volview.Volume, string) {
	t.Helper()
	resp, err := http.Get(url + "/debug/volumes")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r volview.Report
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := volview.WriteTable(&b, &r); err != nil {
		t.Fatal(err)
	}
	for _, v := range r.Volumes {
		if v.ID == id {
			return v, b.String()
		}
	}
	t.Fatalf("volume %s not listed:\n%s", id, b.String())
	return volview.Volume{}, ""
}
