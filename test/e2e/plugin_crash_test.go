package e2e

// Crash safety: the plugin killed with SIGKILL (or its journal left with an
// intent, as a crash in the middle of a step leaves it) and started again.

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/test/testutil"
)

// (a) Killed while a volume is staged and published: the publish survives
// (its mount holds the loop device), the new plugin adopts the same device
// and unpublish + unstage detach exactly that one.
func TestPluginCrashWhilePublished(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "vol-crash-pub"
	e.create(id, "ext4", 32*miB)
	img := e.image(id)
	c := mountCap("ext4", rwo)
	e.stage(id, c, nil)
	target := e.target(id, "mnt")
	e.publish(id, target, c, false, nil)
	plugWriteFile(t, filepath.Join(target, "before"), "before the crash\n")
	l := e.checkStagedLoop(id, img)
	st := e.loopState(id)

	e.plugin.Kill9()
	if m := plugMountsOf(t, os.Getpid(), l.Dev); len(m) != 1 || m[0] != target {
		t.Fatalf("after kill -9 %s is mounted at %v, want %s", l.Path(), m, target)
	}
	if now := plugOneLoop(t, img); now != l {
		t.Fatalf("after kill -9 the image is on %+v, was %+v", now, l)
	}

	e.restart()
	if again := e.checkStagedLoop(id, img); again != l {
		t.Errorf("after restart the volume is on %+v, was %+v", again, l)
	}
	if got := e.loopState(id); got.Device != st.Device || got.Identity != st.Identity {
		t.Errorf("record after restart: %+v, before the crash: %+v", got, st)
	}
	if v := e.mustRecord(id); len(v.Publishes) != 1 || v.Publishes[0].TargetPath != target {
		t.Errorf("record publishes after restart: %+v", v.Publishes)
	}
	if got := plugReadFile(t, filepath.Join(target, "before")); got != "before the crash\n" {
		t.Errorf("read %q", got)
	}
	plugWriteFile(t, filepath.Join(target, "after"), "after the crash\n")
	if _, err := e.node.NodeGetVolumeStats(rpcCtx(t), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target}); err != nil {
		t.Errorf("NodeGetVolumeStats after restart: %v", err)
	}

	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)
	if b, err := plugSysfs(l.Name, "loop/backing_file"); err == nil && b == l.Backing {
		t.Errorf("%s still backed by %s after unstage", l.Path(), b)
	}
	e.delete(id)
}

// (b) Killed while a volume is staged and not published: autoclear drops
// the loop device with the plugin; the reconciler attaches the image again
// and records the new device; publish works.
func TestPluginCrashWhileStaged(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "vol-crash-staged"
	e.create(id, "ext4", 32*miB)
	img := e.image(id)
	c := mountCap("ext4", rwo)
	e.stage(id, c, nil)
	target := e.target(id, "mnt")
	e.publish(id, target, c, false, nil)
	plugWriteFile(t, filepath.Join(target, "f"), "kept\n")
	e.unpublish(id, target)
	e.checkStagedLoop(id, img)

	e.plugin.Kill9()
	waitNoLoop(t, img) // autoclear: the plugin's fd was the last opener

	e.restart()
	l := e.checkStagedLoop(id, img) // re-attached, and the record names the new device
	e.notMounted(l)
	e.publish(id, target, c, false, nil)
	if got := plugReadFile(t, filepath.Join(target, "f")); got != "kept\n" {
		t.Errorf("read %q after re-attach", got)
	}
	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)
	e.delete(id)
}

// (c) A format that a crash interrupted (the record says format pending) is
// redone from scratch at the next stage, whatever the image holds.
func TestPluginCrashInterruptedFormat(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "mkfs.ext4", "e2fsck", "blkid")
	root := startEnv(t, envOptions{})
	rng := rand.New(rand.NewPCG(1, 2))
	garbage := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}

	for i, tc := range []struct {
		name string
		ruin func(t *testing.T, img string)
	}{
		{"garbage in the first MiB", func(t *testing.T, img string) {
			plugWriteAt(t, img, garbage(int(miB)), 0)
		}},
		{"a half-written ext4 that blkid still detects", func(t *testing.T, img string) {
			// mkfs wrote the primary superblock, the rest of the first MiB
			// (group descriptors, bitmaps, inode table) is garbage: a
			// detector trusts it, a mount fails.
			plugRun(t, "mkfs.ext4", "-q", "-F", img)
			plugWriteAt(t, img, garbage(1024), 0)
			plugWriteAt(t, img, garbage(int(miB)-2048), 2048)
			out, _ := exec.Command("blkid", "-p", "-o", "value", "-s", "TYPE", img).Output()
			if strings.TrimSpace(string(out)) != "ext4" {
				t.Fatalf("blkid sees %q on the ruined image, want ext4 (the test needs a plausible superblock)", out)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := root.with(t)
			id := "vol-fmt-" + strconv.Itoa(i)
			e.create(id, "ext4", 32*miB)
			img := e.image(id)
			if err := e.plugin.Stop(); err != nil {
				t.Fatal(err)
			}
			tc.ruin(t, img)
			e.editRecord(id, func(m map[string]any) {
				m["format"] = map[string]any{"fsType": "ext4", "done": false}
			})
			e.restart()

			c := mountCap("ext4", rwo)
			e.stage(id, c, nil)
			if f := e.mustRecord(id).Format; f == nil || !f.Done || f.FsType != "ext4" {
				t.Errorf("record format after stage: %+v", f)
			}
			target := e.target(id, "mnt")
			e.publish(id, target, c, false, nil)
			plugWriteFile(t, filepath.Join(target, "f"), "formatted\n")
			e.unpublish(id, target)
			e.unstage(id)
			waitNoLoop(t, img)
			if out, err := exec.Command("e2fsck", "-f", "-n", img).CombinedOutput(); err != nil {
				t.Errorf("e2fsck of the image after the redone format: %v\n%s", err, out)
			}
			e.delete(id)
		})
	}
}

func plugWriteAt(t *testing.T, path string, b []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// (d) A record left with a stage intent: the reconciler undoes the stage at
// start-up and a new NodeStageVolume works.
func TestPluginCrashStageIntent(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	root := startEnv(t, envOptions{})

	for i, tc := range []struct {
		name string
		edit func(m map[string]any)
	}{
		{"staging, edited from a staged record", func(m map[string]any) {
			m["stage"].(map[string]any)["phase"] = string(model.PhaseStaging)
		}},
		{"unstaging, edited from a staged record", func(m map[string]any) {
			m["stage"].(map[string]any)["phase"] = string(model.PhaseUnstaging)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := root.with(t)
			id := "vol-intent-" + strconv.Itoa(i)
			e.create(id, "ext4", 32*miB)
			img := e.image(id)
			c := mountCap("ext4", rwo)
			e.stage(id, c, nil)
			e.checkStagedLoop(id, img)
			if err := e.plugin.Stop(); err != nil {
				t.Fatal(err)
			}
			waitNoLoop(t, img) // autoclear: nothing mounts it
			e.editRecord(id, tc.edit)
			e.restart()

			if v := e.mustRecord(id); v.Stage != nil {
				t.Errorf("after restart the record still has a stage: %+v (the reconciler did not undo the intent)", v.Stage)
			}
			if ls := plugLoopsBackedBy(t, img); len(ls) != 0 {
				t.Errorf("after restart the image is attached: %+v", ls)
			}
			e.stage(id, c, nil)
			l := e.checkStagedLoop(id, img)
			e.notMounted(l)
			target := e.target(id, "mnt")
			e.publish(id, target, c, false, nil)
			plugWriteFile(t, filepath.Join(target, "f"), "ok\n")
			e.unpublish(id, target)
			e.unstage(id)
			waitNoLoop(t, img)
			e.delete(id)
		})
	}
}
