package e2e

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestSnapshotKilled kills the plugin (kill -9) at a random point inside
// CreateSnapshot and inside CreateVolume from a volume (a clone) of a
// published volume that a writer keeps writing, on an ext4 state dir
// (sparse copies, slow enough for most kills to land in the copy) and on
// an xfs one (reflinks, then a mount of the copy to replay its log). After
// each restart nothing is half-made: the copy is either complete (its
// record done, its image a clean filesystem) or gone without a trace (no
// record, no image, no temp file, no freeze mount), and the source is not
// left frozen (the writer goes on). The CO's retry then succeeds.
func TestSnapshotKilled(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.xfs", "e2fsck", "xfs_repair", "losetup")
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			testutil.NoLeaks(t)
			e := newEnv(t, "")
			mountBacking(t, e, fsType)
			e.startPlugin("")
			snapshotKilled(t, e, fsType)
		})
	}
}

// snapshotKilled runs the kills of TestSnapshotKilled with a volume of
// fsType on a state dir of fsType: ext4 copies, xfs reflinks and then
// replays the copy's log.
func snapshotKilled(t *testing.T, e *env, fsType string) {
	c := mountCap(fsType, rwo)
	e.create("src", fsType, 320*miB)
	e.stage("src", c, nil)
	a := e.target("src", "a")
	e.publish("src", a, c, false, nil)
	data := make([]byte, 128<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>12) // incompressible enough, and not zero: every extent is data
	}
	if err := writeSynced(filepath.Join(a, "data"), data); err != nil {
		t.Fatal(err)
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed>>1))

	ops := []struct {
		name     string
		run      func(name string) error
		image    func(name string) string
		complete func(name string) (exists, done bool)
		remove   func(name string)
	}{
		{
			name:  "snapshot",
			run:   func(n string) error { _, err := e.tryCreateSnapshot(n, "src"); return err },
			image: e.snapshotImage,
			complete: func(n string) (bool, bool) {
				rec, err := e.snapshotRecord(n)
				return err == nil, err == nil && !rec.Creating && !rec.Frozen
			},
			remove: e.deleteSnapshot,
		},
		{
			name:  "clone",
			run:   func(n string) error { _, err := e.tryCreateFrom(n, 0, c, volumeSource("src")); return err },
			image: e.image,
			complete: func(n string) (bool, bool) {
				rec, err := e.record(n)
				return err == nil, err == nil && !rec.Creating
			},
			remove: e.delete,
		},
	}
	const rounds = 4
	for _, op := range ops {
		// How long the op takes uninterrupted: kills land in 0..1.2 of it.
		t0 := time.Now()
		if err := op.run(op.name + "-timed"); err != nil {
			t.Fatalf("%s: %v", op.name, err)
		}
		took := time.Since(t0)
		op.remove(op.name + "-timed")
		t.Logf("%s of 128 MiB of data takes %v", op.name, took)
		var interrupted, finished int
		for r := range rounds {
			name := fmt.Sprintf("%s-%d", op.name, r)
			w := startWriter(a, name)
			w.waitFor(t, 2, 30*time.Second, "before the kill")
			done := make(chan error, 1)
			go func() { done <- op.run(name) }()
			time.Sleep(time.Duration(rng.Int64N(int64(took) * 6 / 5)))
			e.plugin.Kill9()
			if err := <-done; err != nil {
				interrupted++
			} else {
				finished++
			}
			e.restart()
			w.waitFor(t, 3, 30*time.Second, fmt.Sprintf("%s round %d: after the restart: the source was left frozen?", op.name, r))
			w.removeFiles(t)
			if left := e.leftovers(t); len(left) > 0 {
				t.Errorf("%s round %d: left after the restart: %v", op.name, r, left)
			}
			_, imgErr := os.Stat(op.image(name))
			switch exists, complete := op.complete(name); {
			case complete:
				if imgErr != nil {
					t.Errorf("%s round %d: complete, but its image: %v", op.name, r, imgErr)
				}
			case exists:
				t.Errorf("%s round %d: a half-made record after the restart", op.name, r)
			case !os.IsNotExist(imgErr):
				t.Errorf("%s round %d: no record, but an image (%v)", op.name, r, imgErr)
			}
			// The CO retries; the copy then holds a clean filesystem.
			if err := op.run(name); err != nil {
				t.Fatalf("%s round %d: the retry after the restart: %v", op.name, r, err)
			}
			fsck(t, fsType, op.image(name))
			op.remove(name)
		}
		t.Logf("%s: %d kills interrupted the call, %d came after it finished", op.name, interrupted, finished)
	}
	e.unpublish("src", a)
	e.unstage("src")
	e.delete("src")
}
