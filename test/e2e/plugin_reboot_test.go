package e2e

// A reboot played with the real binaries: the plugin reads its boot ID
// from a file (--boot-id-file) the test rewrites, since the host kernel
// does not reboot.

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/test/testutil"
)

// A volume staged and published, with data, when the "power goes": the
// plugin dies, the publish's mount and the loop device go as the kernel
// would drop them, the mounter's records are of an ended boot. The plugin
// started in the new boot attaches nothing before kubelet asks, says so
// in its log, and kubelet's stage and publish bring the data back on a
// device of this boot; unpublish, unstage and delete leave nothing.
func TestPluginPlayedReboot(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	bootFile := filepath.Join(t.TempDir(), "boot_id")
	setBoot := func(id string) {
		if err := os.WriteFile(bootFile, []byte(id+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	setBoot("played-boot-a")
	e := startEnv(t, envOptions{args: []string{"--boot-id-file", bootFile}})
	const id = "vol-reboot"
	e.create(id, "ext4", 32*miB)
	img := e.image(id)
	c := mountCap("ext4", rwo)
	e.stage(id, c, nil)
	target := e.target(id, "mnt")
	e.publish(id, target, c, false, nil)
	plugWriteFile(t, filepath.Join(target, "before"), "before the reboot\n")
	before := e.checkStagedLoop(id, img)

	// The power goes.
	e.plugin.Kill9()
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	waitNoLoop(t, img)
	testutil.EndMounterBoot(t, mounter.DefaultRecordsDir(e.stateDir()))
	setBoot("played-boot-b")

	e.restart()
	if log := e.plugin.Log(); !strings.Contains(log, "node rebooted since the last run (boot played-boot-a -> played-boot-b)") {
		t.Errorf("the plugin did not log the reboot:\n%s", log)
	}
	if v := e.mustRecord(id); v.Stage != nil || len(v.Publishes) != 0 || v.Rebooted == nil || v.Rebooted.Boot != "played-boot-a" {
		t.Errorf("record after the reboot: stage %+v, publishes %+v, rebooted %+v", v.Stage, v.Publishes, v.Rebooted)
	}
	if ls := plugLoopsBackedBy(t, img); len(ls) != 0 {
		t.Errorf("the image is attached before kubelet asks: %+v", ls)
	}

	// Kubelet stages and publishes again.
	e.stage(id, c, nil)
	e.publish(id, target, c, false, nil)
	after := e.checkStagedLoop(id, img)
	if got := plugReadFile(t, filepath.Join(target, "before")); got != "before the reboot\n" {
		t.Errorf("after the reboot read %q", got)
	}
	if v := e.mustRecord(id); v.Rebooted != nil || len(v.Publishes) != 1 || !v.Publishes[0].CreatedTarget {
		t.Errorf("record after the new stage and publish: rebooted %+v, publishes %+v", v.Rebooted, v.Publishes)
	}
	t.Logf("staged on %s before the reboot, %s after", before.Path(), after.Path())
	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)
	e.delete(id)
}
