package e2e

import (
	"crypto/rand"
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestSnapshotUnderWrites snapshots and clones a published volume while a
// writer keeps writing and syncing files into it, restores the snapshot
// into a bigger volume and checks every copy: a clean filesystem (fsck
// of the image), every file synced before the copy was asked for present
// with its content, the restored filesystem grown. The state dir is on
// xfs (copies are reflinks) and on ext4 (sparse copies), and the copy
// method and GetCapacity follow.
func TestSnapshotUnderWrites(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.xfs", "e2fsck", "xfs_repair", "xfs_growfs", "resize2fs", "losetup", "fsfreeze")
	for _, tc := range []struct {
		backing, fsType, method string
	}{
		{"xfs", "xfs", "reflink"},
		{"ext4", "ext4", "copy"},
	} {
		t.Run(tc.method, func(t *testing.T) {
			testutil.NoLeaks(t)
			e := newEnv(t, "")
			mountBacking(t, e, tc.backing)
			e.startPlugin("")
			snapshotUnderWrites(t, e, tc.fsType, tc.method)
		})
	}
}

func snapshotUnderWrites(t *testing.T, e *env, fsType, method string) {
	c := mountCap(fsType, rwo)
	e.create("src", fsType, 320*miB)
	e.stage("src", c, nil)
	a := e.target("src", "a")
	e.publish("src", a, c, false, nil)
	defer func() {
		e.unpublish("src", a)
		e.unstage("src")
		e.delete("src")
	}()
	base := make([]byte, 64<<20)
	_, _ = rand.Read(base)
	if err := writeSynced(filepath.Join(a, "base"), base); err != nil {
		t.Fatal(err)
	}
	before := capacity(t, e)

	// A snapshot while the writer writes.
	w := startWriter(a, "s")
	w.waitFor(t, 5, 30*time.Second, "before the copy")
	want := w.files()
	want["base"] = sha256.Sum256(base)
	t0 := time.Now()
	if _, err := e.tryCreateSnapshot("snap", "src"); err != nil {
		t.Fatalf("CreateSnapshot of a volume in use: %v", err)
	}
	t.Logf("snapshot of a published %s volume holding 64 MiB under writes: %v", fsType, time.Since(t0))
	w.waitFor(t, 3, 30*time.Second, "after the snapshot: the filesystem was left frozen?")
	w.halt(t)
	rec, err := e.snapshotRecord("snap")
	if err != nil || rec.Method != method || rec.Creating || rec.Frozen {
		t.Fatalf("snapshot record %+v (%v), want method %s, complete", rec, err, method)
	}
	// GetCapacity counts the snapshot: a copy takes the data's space, a
	// reflink none.
	drop := before - capacity(t, e)
	t.Logf("GetCapacity dropped by %d MiB", drop>>20)
	if method == "copy" && drop < 60<<20 {
		t.Errorf("a sparse copy of 64 MiB of data: GetCapacity dropped by %d bytes only", drop)
	}
	if method == "reflink" && drop > 32<<20 {
		t.Errorf("a reflink: GetCapacity dropped by %d bytes", drop)
	}
	fsck(t, fsType, e.snapshotImage("snap"))

	// Restore into a bigger volume: the filesystem grows at its stage.
	if _, err := e.tryCreateFrom("restored", 400*miB, c, snapshotSource("snap")); err != nil {
		t.Fatalf("CreateVolume from the snapshot: %v", err)
	}
	checkCopy(t, e, "restored", c, want, 320*miB)

	// A clone of the volume while the writer writes.
	w = startWriter(a, "c")
	w.waitFor(t, 5, 30*time.Second, "before the copy")
	want = w.files()
	want["base"] = sha256.Sum256(base)
	if _, err := e.tryCreateFrom("clone", 0, c, volumeSource("src")); err != nil {
		t.Fatalf("CreateVolume from a volume in use: %v", err)
	}
	w.waitFor(t, 3, 30*time.Second, "after the clone: the filesystem was left frozen?")
	w.halt(t)
	fsck(t, fsType, e.image("clone"))
	checkCopy(t, e, "clone", c, want, 0)

	// A filesystem someone else froze is refused, and left frozen.
	plugRun(t, "fsfreeze", "--freeze", a)
	_, err = e.tryCreateSnapshot("snap2", "src")
	if out, ferr := exec.Command("fsfreeze", "--unfreeze", a).CombinedOutput(); ferr != nil {
		t.Fatalf("the plugin thawed a filesystem it did not freeze (fsfreeze --unfreeze: %v: %s)", ferr, out)
	}
	testutil.WantCode(t, "CreateSnapshot of a filesystem frozen by someone else", err, codes.FailedPrecondition, "frozen already")
	if _, err := os.Stat(e.snapshotImage("snap2")); !os.IsNotExist(err) {
		t.Errorf("a refused snapshot left its image: %v", err)
	}
	e.deleteSnapshot("snap")
	if left := e.leftovers(t); len(left) > 0 {
		t.Errorf("left in the state dir: %v", left)
	}
}

// checkCopy stages and publishes a copy, checks its files, and that a
// copy bigger than its source's smaller (than bigger) got a grown
// filesystem, then removes it.
func checkCopy(t *testing.T, e *env, id string, c *csi.VolumeCapability, want map[string][sha256.Size]byte, grownFrom int64) {
	t.Helper()
	e.stage(id, c, nil)
	b := e.target(id, "b")
	e.publish(id, b, c, false, nil)
	checkFiles(t, b, want)
	var st unix.Statfs_t
	if err := unix.Statfs(b, &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(st.Blocks) * st.Bsize; grownFrom > 0 && size <= grownFrom {
		t.Errorf("%s: the filesystem holds %d bytes, not grown past its source's %d", id, size, grownFrom)
	}
	if rec := e.mustRecord(id); rec.GrowFilesystem {
		t.Errorf("%s: the record still asks for a grow after the stage", id)
	}
	e.unpublish(id, b)
	e.unstage(id)
	e.delete(id)
}

func capacity(t *testing.T, e *env) int64 {
	t.Helper()
	r, err := e.ctl.GetCapacity(e.ctx(), &csi.GetCapacityRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return r.GetAvailableCapacity()
}

// TestSnapshotRefusals: a raw block volume in use cannot be frozen, so it
// is not copied.
func TestSnapshotRefusals(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	c := blockCap(rwo)
	e.createFor("blk", 16*miB, c)
	e.stage("blk", c, nil)
	tgt := e.target("blk", "dev")
	e.publish("blk", tgt, c, false, nil)
	_, err := e.tryCreateSnapshot("s", "blk")
	testutil.WantCode(t, "CreateSnapshot of a raw block volume in use", err, codes.FailedPrecondition, "raw block")
	_, err = e.tryCreateFrom("clone", 0, c, volumeSource("blk"))
	testutil.WantCode(t, "clone of a raw block volume in use", err, codes.FailedPrecondition, "raw block")
	e.unpublish("blk", tgt)
	// Staged but published nowhere: nothing writes, the copy is taken.
	if _, err := e.tryCreateSnapshot("s", "blk"); err != nil {
		t.Errorf("CreateSnapshot of a block volume staged but unused: %v", err)
	}
	e.unstage("blk")
	e.deleteSnapshot("s")
	e.delete("blk")
}

// TestCopyOfDirtyXFS: a volume whose xfs log is dirty though nothing has
// it mounted (its node crashed while it was) is cloned and restored from
// a snapshot: each copy gets its log replayed before its new UUID, and
// mounts with the data written before.
func TestCopyOfDirtyXFS(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.xfs", "xfs_repair", "fsfreeze", "cp")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	c := mountCap("xfs", rwo)
	e.create("src", "xfs", 320*miB)
	e.stage("src", c, nil)
	a := e.target("src", "a")
	e.publish("src", a, c, false, nil)
	data := make([]byte, 1<<20)
	_, _ = rand.Read(data)
	if err := writeSynced(filepath.Join(a, "f"), data); err != nil {
		t.Fatal(err)
	}
	want := map[string][sha256.Size]byte{"f": sha256.Sum256(data)}
	// The image as a crash would leave it: a frozen xfs's log is dirty.
	dirty := filepath.Join(e.dir, "dirty.img")
	plugRun(t, "fsfreeze", "--freeze", a)
	out, err := exec.Command("cp", "--sparse=always", e.image("src"), dirty).CombinedOutput()
	plugRun(t, "fsfreeze", "--unfreeze", a)
	if err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	e.unpublish("src", a)
	e.unstage("src")
	plugRun(t, "cp", "--sparse=always", dirty, e.image("src"))
	if err := exec.Command("xfs_repair", "-n", "-f", e.image("src")).Run(); err == nil {
		t.Fatal("xfs_repair finds the source's log clean: the test makes no dirty log")
	}

	if _, err := e.tryCreateFrom("clone", 0, c, volumeSource("src")); err != nil {
		t.Fatalf("clone of an xfs with a dirty log: %v", err)
	}
	fsck(t, "xfs", e.image("clone"))
	checkCopy(t, e, "clone", c, want, 0)
	if _, err := e.tryCreateSnapshot("snap", "src"); err != nil {
		t.Fatalf("CreateSnapshot: %v", err)
	}
	if _, err := e.tryCreateFrom("restored", 0, c, snapshotSource("snap")); err != nil {
		t.Fatalf("restore of a snapshot of an xfs with a dirty log: %v", err)
	}
	checkCopy(t, e, "restored", c, want, 0)
	e.deleteSnapshot("snap")
	e.delete("src")
	if left := e.leftovers(t); len(left) > 0 {
		t.Errorf("left in the state dir: %v", left)
	}
}
