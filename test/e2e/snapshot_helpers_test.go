package e2e

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// mountBacking puts the plugin's state dir on a filesystem of its own: a
// sparse image of fsType on a loop device (xfs shares extents, so copies
// are reflinks; ext4 does not, so they are sparse copies). Call it before
// the plugin starts: its cleanup then runs after the plugin's.
func mountBacking(t *testing.T, e *env, fsType string) {
	t.Helper()
	img := filepath.Join(e.dir, "state-"+fsType+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 3<<30); err != nil {
		t.Fatal(err)
	}
	plugRun(t, "mkfs."+fsType, "-q", img)
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup --detach %s: %v: %s", dev, err, out)
		}
	})
	dir := e.stateDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev, dir, fsType, 0, ""); err != nil {
		t.Fatalf("mount %s at %s: %v", dev, dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount the state dir: %v", err)
		}
	})
}

// writer writes files of 256 KiB of random data into dir, each synced,
// until stopped, and remembers the checksum of each once synced: the
// files a copy taken afterwards must hold.
type writer struct {
	dir, prefix string
	mu          sync.Mutex
	synced      map[string][sha256.Size]byte
	err         error
	stop        chan struct{}
	done        chan struct{}
}

func startWriter(dir, prefix string) *writer {
	w := &writer{dir: dir, prefix: prefix, synced: map[string][sha256.Size]byte{}, stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w
}

func (w *writer) run() {
	defer close(w.done)
	buf := make([]byte, 256<<10)
	for i := 0; ; i++ {
		select {
		case <-w.stop:
			return
		default:
		}
		name := fmt.Sprintf("%s-%05d", w.prefix, i)
		_, _ = rand.Read(buf)
		if err := writeSynced(filepath.Join(w.dir, name), buf); err != nil {
			w.mu.Lock()
			w.err = err
			w.mu.Unlock()
			return
		}
		w.mu.Lock()
		w.synced[name] = sha256.Sum256(buf)
		w.mu.Unlock()
	}
}

func writeSynced(path string, data []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// files returns a copy of what is synced so far.
func (w *writer) files() map[string][sha256.Size]byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string][sha256.Size]byte, len(w.synced))
	for k, v := range w.synced {
		out[k] = v
	}
	return out
}

// waitFor waits until n more files than now are synced: the writer makes
// progress (a frozen filesystem stops it). It fails the test, saying why,
// when the writer stopped on an error (a full filesystem, an I/O error) or
// made no progress within timeout: then what is the suspected cause.
func (w *writer) waitFor(t *testing.T, n int, timeout time.Duration, what string) {
	t.Helper()
	start := len(w.files())
	var werr error
	progressed := testutil.Poll(timeout, 5*time.Millisecond, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		werr = w.err
		return werr != nil || len(w.synced) >= start+n
	})
	switch {
	case werr != nil:
		t.Fatalf("the writer in %s stopped after %d files: %v", w.dir, len(w.files()), werr)
	case !progressed:
		t.Fatalf("the writer in %s made no progress in %v (%d files so far): %s\n%s", w.dir, timeout, len(w.files()), what, blockedTasks())
	}
}

// blockedTasks describes this process's threads in uninterruptible sleep
// with their kernel stacks: where a stalled writer waits (a freeze shows
// as sb_start_write or percpu_rwsem_wait) tells a frozen filesystem from
// anything else.
func blockedTasks() string {
	dirs, _ := filepath.Glob("/proc/self/task/*")
	var b strings.Builder
	for _, d := range dirs {
		stat, err := os.ReadFile(filepath.Join(d, "stat"))
		if err != nil {
			continue
		}
		// The state follows the parenthesised command name.
		if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) || stat[i+2] != 'D' {
			continue
		}
		stack, _ := os.ReadFile(filepath.Join(d, "stack"))
		fmt.Fprintf(&b, "thread %s in D state:\n%s", filepath.Base(d), stack)
	}
	if b.Len() == 0 {
		return "no thread of the test is in uninterruptible sleep"
	}
	return b.String()
}

// removeFiles halts the writer and removes what it wrote, so that rounds
// of writing do not fill the volume.
func (w *writer) removeFiles(t *testing.T) {
	t.Helper()
	w.halt(t)
	for name := range w.files() {
		if err := os.Remove(filepath.Join(w.dir, name)); err != nil {
			t.Fatal(err)
		}
	}
}

// halt stops the writer and returns its error, if any.
func (w *writer) halt(t *testing.T) {
	t.Helper()
	close(w.stop)
	select {
	case <-w.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the writer in %s is stuck (a filesystem left frozen?)", w.dir)
	}
	if w.err != nil {
		t.Fatalf("writer in %s: %v", w.dir, w.err)
	}
}

// checkFiles checks that dir holds every file of want with its content.
func checkFiles(t *testing.T, dir string, want map[string][sha256.Size]byte) {
	t.Helper()
	for name, sum := range want {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s, written and synced before the copy: %v", name, err)
			continue
		}
		if sha256.Sum256(b) != sum {
			t.Errorf("%s differs from what was written before the copy", name)
		}
	}
}

// fsck checks an image's filesystem read-only: it must be clean.
func fsck(t *testing.T, fsType, img string) {
	t.Helper()
	var cmd *exec.Cmd
	switch fsType {
	case "xfs":
		cmd = exec.Command("xfs_repair", "-n", "-f", img)
	default:
		cmd = exec.Command("e2fsck", "-f", "-n", img)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s of %s: %v\n%s", cmd.Args[0], img, err, out)
	}
}

func (e *env) snapshotImage(id string) string { return loop.SnapshotImagePath(e.stateDir(), id) }

// snapshotRecord reads a snapshot's record from the state dir.
func (e *env) snapshotRecord(id string) (*model.Snapshot, error) {
	b, err := os.ReadFile(filepath.Join(e.stateDir(), "snapshots", id+".json"))
	if err != nil {
		return nil, err
	}
	s := &model.Snapshot{}
	return s, json.Unmarshal(b, s)
}

func (e *env) tryCreateSnapshot(name, src string) (*csi.Snapshot, error) {
	r, err := e.ctl.CreateSnapshot(e.ctx(), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: src})
	return r.GetSnapshot(), err
}

func (e *env) deleteSnapshot(id string) {
	e.t.Helper()
	if _, err := e.ctl.DeleteSnapshot(e.ctx(), &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
		e.t.Fatalf("DeleteSnapshot %s: %v", id, err)
	}
	if _, err := os.Stat(e.snapshotImage(id)); !os.IsNotExist(err) {
		e.t.Errorf("image of snapshot %s after DeleteSnapshot: %v", id, err)
	}
}

// createFrom provisions volume name as a copy of cs for capability c.
func (e *env) tryCreateFrom(name string, size int64, c *csi.VolumeCapability, cs *csi.VolumeContentSource) (*csi.Volume, error) {
	r, err := e.ctl.CreateVolume(e.ctx(), &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: map[string]string{"type": "loop"}, VolumeContentSource: cs})
	return r.GetVolume(), err
}

func snapshotSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func volumeSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

// leftovers lists what an interrupted copy could leave in the state dir:
// temp files of images and records, private freeze mounts and the mounts
// that replay a copied xfs's log.
func (e *env) leftovers(t *testing.T) []string {
	t.Helper()
	out := tempFilesUnder(t, e.stateDir())
	if ents, err := os.ReadDir(filepath.Join(e.stateDir(), "freeze")); err == nil {
		for _, ent := range ents {
			out = append(out, "freeze/"+ent.Name())
		}
	}
	for _, kind := range []string{"snapshots", "volumes"} {
		if ents, err := os.ReadDir(filepath.Join(e.stateDir(), "recover", kind)); err == nil {
			for _, ent := range ents {
				out = append(out, "recover/"+kind+"/"+ent.Name())
			}
		}
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	for _, dir := range []string{"freeze", "recover"} {
		if strings.Contains(string(mi), filepath.Join(e.stateDir(), dir)) {
			out = append(out, "a mount under "+dir)
		}
	}
	return out
}
