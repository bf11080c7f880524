package e2e

// The plugin crashes (SIGKILL) while a consumer has a prepared volume
// mounted: the consumer keeps working, and the restarted plugin adopts the
// staged volume and still knows the consumer from its journal.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestPrepareRestartAdopts(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})

	// No NoLeaks in the subtests: the plugin each restarts is a new process
	// that outlives them. The test's own check covers everything.
	t.Run("ext4", func(t *testing.T) {
		e := e.with(t)
		id := e.create("prep-restart", "", 32*miB).GetVolumeId()
		image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
		e.stage(id, mountCap("", rwo), nil)
		prepRestartCase(t, e, id, image, nil, nil)
		e.delete(id)
	})

	t.Run("overlay-chain", func(t *testing.T) {
		testutil.RequireCommands(t, "mksquashfs")
		e := e.with(t)
		content := filepath.Join(t.TempDir(), "content")
		if err := os.Mkdir(content, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(content, "base"), []byte("base\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		image := filepath.Join(e.imageRoot, "restart.squashfs")
		prepRun(t, "mksquashfs", content, image, "-noappend", "-quiet", "-no-progress")
		id := "static-restart-chain"
		e.stage(id, mountCap("", rwo), map[string]string{"type": "loop", "image": image, "overlay": "true"})
		ch := e.loopState(id).Chain
		if ch == nil {
			t.Fatal("no chain in the journal")
		}
		// The lower layer is a host mount of the device by design; the
		// overlay must never be one.
		overlayOnHost := func(mi *mountinfo.Info) bool {
			return mi.FSType == "overlay" && strings.Contains(mi.VFSOptions, ch.Dir)
		}
		prepRestartCase(t, e, id, image, overlayOnHost, func(target string) {
			// The chain's layers outlived the plugin; the overlay still
			// reads the image and writes to the same upper.
			for _, p := range []string{ch.Lower, ch.Upper} {
				if prepHostMountAt(t, p) == nil {
					t.Errorf("chain layer %s is not mounted after the restart", p)
				}
			}
			if st := e.loopState(id); st.Chain == nil || *st.Chain != *ch {
				t.Errorf("after the restart the chain is %+v, want %+v (adopted, not rebuilt)", st.Chain, ch)
			}
			if b, err := os.ReadFile(filepath.Join(ch.Upper, "data", "before")); err != nil || string(b) != "before\n" {
				t.Errorf("upper layer's file from before the crash: %q, %v", b, err)
			}
		})
		if _, err := os.Lstat(ch.Dir); !os.IsNotExist(err) {
			t.Errorf("chain dir %s left after unstage: %v", ch.Dir, err)
		}
	})

	// The consumer dies while the plugin is down: nobody holds the loop
	// device any more, so the kernel clears it (autoclear); the restarted
	// plugin's startup reconcile drops the dead consumer from the journal
	// and attaches the image again for the still-staged volume.
	t.Run("consumer-dies-while-plugin-down", func(t *testing.T) {
		e := e.with(t)
		id := e.create("prep-restart-dead", "", 32*miB).GetVolumeId()
		image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
		e.stage(id, mountCap("", rwo), nil)
		dev := e.stagedDevice(id, image)
		watch := prepDevWatch(t, dev)
		ns := testutil.StartUnshare(t)
		target := filepath.Join(t.TempDir(), "consumer")
		if err := os.Mkdir(target, 0o755); err != nil {
			t.Fatal(err)
		}
		e.mustSidecarMount(id, ns.PID, target)
		e.wantConsumer(id, ns.PID, target)
		if _, err := ns.Exec(t, "sh", "-c", "echo kept > "+target+"/kept && sync"); err != nil {
			t.Fatal(err)
		}
		pid := ns.PID

		e.plugin.Kill9()
		ns.Kill()
		waitNoLoop(t, image) // no opener left: the kernel detached it
		e.plugin.Restart()
		e.waitReady() // ready only after the startup reconcile
		if cs := e.consumers(id); len(cs) != 0 {
			t.Errorf("after the restart the journal still records consumers %+v (pid %d is dead)", cs, pid)
		}
		st := e.loopState(id)
		if got := loopBackingFile(filepath.Base(st.Device)); got != image {
			t.Errorf("after the restart the journal names %s, backed by %q; want it re-attached to %s", st.Device, got, image)
		}
		// The data written before the crash is on the image.
		ns2 := testutil.StartUnshare(t)
		e.mustSidecarMount(id, ns2.PID, target)
		if out, err := ns2.Exec(t, "cat", target+"/kept"); err != nil || out != "kept\n" {
			t.Errorf("reading the file written before the crash: %q, %v", out, err)
		}
		e.mustSidecarUnmount(id, ns2.PID, target)
		e.unstage(id)
		waitNoLoop(t, image)
		e.delete(id)
		ns2.Kill()
		watch.check(t, dev.String()+" mounted")
	})

	if n := strings.Count(e.plugin.Log(), "=== start "); n != 4 {
		t.Errorf("plugin log shows %d starts, want 4", n)
	}
}

// prepRestartCase mounts the staged volume id into an unshare namespace,
// kills the plugin with SIGKILL, checks the consumer through the crash and
// the restart, then unmounts and unstages.
// onHost says what the host's mount table must never show; nil: the
// volume's device.
func prepRestartCase(t *testing.T, e *env, id, image string, onHost func(*mountinfo.Info) bool, afterRestart func(target string)) {
	tm := prepTimer(t)
	dev := e.stagedDevice(id, image)
	what := "the volume mounted"
	var watch *prepWatch
	if onHost == nil {
		watch = prepDevWatch(t, dev)
		what = dev.String() + " mounted"
	} else {
		watch = prepWatchHost(t, what, onHost)
	}
	ns := testutil.StartUnshare(t)
	target := filepath.Join(t.TempDir(), "consumer")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	e.mustSidecarMount(id, ns.PID, target)
	cons := e.wantConsumer(id, ns.PID, target)
	if _, err := ns.Exec(t, "sh", "-c", "echo before > "+target+"/before && sync"); err != nil {
		t.Fatal(err)
	}
	tm.step(fmt.Sprintf("staged on %s and mounted in pid %d", dev, ns.PID))

	first := e.plugin.PID()
	e.plugin.Kill9()
	// With the plugin dead the consumer keeps its volume: its mount holds
	// the loop device, so autoclear does not release it.
	if out, err := ns.Exec(t, "sh", "-c", "cat "+target+"/before && echo during > "+target+"/during && sync && cat "+target+"/during"); err != nil || out != "before\nduring\n" {
		t.Errorf("consumer while the plugin is dead: %q, %v", out, err)
	}
	if got := loopBackingFile(dev.name()); got != image {
		t.Errorf("with the plugin dead, %s is backed by %q, want %q", dev, got, image)
	}
	tm.step("plugin killed with SIGKILL; the consumer still reads and writes")

	e.plugin.Restart()
	e.waitReady()
	if e.plugin.PID() == first {
		t.Fatal("the plugin was not restarted")
	}
	if out, err := ns.Exec(t, "sh", "-c", "cat "+target+"/before "+target+"/during && echo after > "+target+"/after && sync && cat "+target+"/after"); err != nil || out != "before\nduring\nafter\n" {
		t.Errorf("consumer after the restart: %q, %v", out, err)
	}
	// The journal kept the consumer; the restarted plugin adopted the device.
	e.wantConsumer(id, ns.PID, target)
	if d := e.stagedDevice(id, image); d != dev {
		t.Errorf("after the restart the journal names %s, want the adopted %s", d, dev)
	}
	if afterRestart != nil {
		afterRestart(target)
	}
	err := e.tryUnstage(id)
	testutil.WantCode(t, "NodeUnstageVolume after the restart, consumer alive", err, codes.FailedPrecondition,
		fmt.Sprintf("pid %d", ns.PID))
	if got := loopBackingFile(dev.name()); got != image {
		t.Errorf("after the refused unstage %s is backed by %q, want %q", dev, got, image)
	}
	tm.step("restarted; unstage still refused")

	e.mustSidecarUnmount(id, ns.PID, target, "--mnt-ns-inode", fmt.Sprint(cons.Namespace.Inode))
	e.wantNoConsumer(id)
	e.unstage(id)
	waitNoLoop(t, image)
	ns.Kill()
	watch.check(t, what)
	tm.step("unmounted, unstaged: device detached")
}
