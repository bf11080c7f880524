package e2e

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestPluginDeleteRefusesAttachedImage: an image that a loop device still
// reads (attached behind the plugin's back, as a leaked mount elsewhere
// would keep it) is not deleted; once the device is gone, it is.
func TestPluginDeleteRefusesAttachedImage(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "losetup")
	e := startEnv(t, envOptions{})
	vol := e.create("plug-delete-attached", "ext4", 32<<20)
	id := vol.GetVolumeId()

	out, err := exec.Command("losetup", "--find", "--show", e.image(id)).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	dev := strings.TrimSpace(string(out))
	detached := false
	detach := func() {
		if !detached {
			if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
				t.Errorf("losetup -d %s: %v %s", dev, err, out)
			}
			detached = true
		}
	}
	t.Cleanup(detach)

	_, err = e.ctl.DeleteVolume(rpcCtx(t), &csi.DeleteVolumeRequest{VolumeId: id})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("DeleteVolume with %s attached: %v, want FailedPrecondition", dev, err)
	}
	if !strings.Contains(status.Convert(err).Message(), dev) {
		t.Errorf("error does not name %s: %v", dev, err)
	}
	if _, err := os.Stat(e.image(id)); err != nil {
		t.Fatalf("the image went away although refused: %v", err)
	}
	detach()
	waitNoLoop(t, e.image(id))
	e.delete(id)
}
