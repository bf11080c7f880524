package journal

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestPutGetDeleteRoundTrip(t *testing.T) {
	for _, d := range []Durability{Runtime, Durable} {
		testRoundTrip(t, d)
	}
}

func testRoundTrip(t *testing.T, d Durability) {
	s, err := OpenVolumes(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	v := &model.Volume{ID: "pvc-1", Kind: model.KindProvisioned, Type: "loop", CapacityBytes: 1 << 20,
		Stage: &model.Stage{Phase: model.PhaseStaged, StagingPath: "/s", Source: json.RawMessage(`{"device":"/dev/loop1"}`)},
		Consumers: []model.Claim{{Consumer: plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 7}},
			Mounts: []plan.Mount{{Type: "ext4", Source: "/dev/loop1", Options: []string{"nosuid", "nodev"}}}}}}
	if _, err := s.Put(v.ID, v, d); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("pvc-1")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Staged() || got.Consumers[0].Namespace.Inode != 7 || string(got.Stage.Source) != `{"device":"/dev/loop1"}` ||
		got.Consumers[0].Mounts[0].Options[1] != "nodev" {
		t.Fatalf("round trip lost data: %+v", got)
	}
	list, err := s.List()
	if err != nil || len(list) != 1 {
		t.Fatalf("List = %v, %v", list, err)
	}
	if err := s.Delete("pvc-1", d); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("pvc-1", d); err != nil {
		t.Fatalf("second delete: %v", err)
	}
	if _, err := s.Get("pvc-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get after delete: %v, want ErrNotFound", err)
	}
}

func TestAtomicWriteLeavesNoTempAndKeepsOldOnFailure(t *testing.T) {
	dir := t.TempDir()
	s, err := OpenVolumes(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put("v", &model.Volume{ID: "v", Kind: model.KindStatic}, Durable); err != nil {
		t.Fatal(err)
	}
	// A directory where the temp file would go makes the next write fail
	// after the old record exists: the old record must survive intact.
	if err := os.Chmod(s.dir, 0o500); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Chmod(s.dir, 0o700) })
	if os.Geteuid() != 0 { // root ignores directory permissions
		if _, err := s.Put("v", &model.Volume{ID: "v", Kind: model.KindProvisioned}, Durable); err == nil {
			t.Fatal("write into a read-only dir succeeded")
		}
		got, err := s.Get("v")
		if err != nil || got.Kind != model.KindStatic {
			t.Fatalf("old record damaged: %+v %v", got, err)
		}
	}
	_ = os.Chmod(s.dir, 0o700)
	entries, _ := os.ReadDir(filepath.Join(dir, "volumes"))
	for _, e := range entries {
		if e.Name() != "v.json" && e.Name() != "v.json.durable" {
			t.Errorf("stray file %s left in the journal dir", e.Name())
		}
	}
}

func TestListReportsCorruptRecords(t *testing.T) {
	s, err := OpenVolumes(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put("good", &model.Volume{ID: "good", Kind: model.KindStatic}, Durable); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.dir, "bad.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	list, err := s.List()
	if err == nil {
		t.Fatal("a corrupt record went unreported")
	}
	if len(list) != 1 || list[0].ID != "good" {
		t.Fatalf("good record lost: %+v", list)
	}
}

func TestRuntimeOverwriteShrinksAndGrows(t *testing.T) {
	s, err := OpenVolumes(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	big := &model.Volume{ID: "v", Kind: model.KindProvisioned, Image: strings.Repeat("x", 500)}
	small := &model.Volume{ID: "v", Kind: model.KindStatic}
	huge := &model.Volume{ID: "v", Kind: model.KindEphemeral, Image: strings.Repeat("y", 6000)}
	for i, v := range []*model.Volume{big, small, big, huge, small} {
		// Put's bytes are what the driver caches and decodes
		// later: they must be the record, not the space-padded file.
		rec, err := s.Put(v.ID, v, Runtime)
		if err != nil {
			t.Fatalf("put %d: %v", i, err)
		}
		got, err := s.Get("v")
		if err != nil {
			t.Fatalf("get %d: %v", i, err)
		}
		if got.Kind != v.Kind || got.Image != v.Image {
			t.Fatalf("put %d: read back %s/%d bytes of image, want %s/%d", i, got.Kind, len(got.Image), v.Kind, len(v.Image))
		}
		var cached model.Volume
		if err := json.Unmarshal(rec, &cached); err != nil || cached.Kind != v.Kind || cached.Image != v.Image {
			t.Fatalf("put %d: returned record %.60q (%v), want the volume's JSON", i, rec, err)
		}
	}
}

// A runtime rewrite in place torn by a machine crash must not lose the
// record: the durable copy (what is on disk) takes over.
func TestTornRuntimeRecordFallsBackToDurableCopy(t *testing.T) {
	s, err := OpenVolumes(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	v := &model.Volume{ID: "v", Kind: model.KindProvisioned, Image: "/img", Format: &model.Format{FsType: "ext4", Done: true}}
	if _, err := s.Put(v.ID, v, Durable); err != nil {
		t.Fatal(err)
	}
	v.Stage = &model.Stage{Phase: model.PhaseStaged, StagingPath: "/s"}
	if _, err := s.Put(v.ID, v, Runtime); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get("v"); err != nil || !got.Staged() {
		t.Fatalf("runtime write not read back: %+v %v", got, err)
	}
	b, err := os.ReadFile(s.path("v"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(s.path("v"), b[:len(b)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("v")
	if err != nil {
		t.Fatalf("torn record: %v", err)
	}
	if got.Stage != nil || got.Format == nil || !got.Format.Done || got.Image != "/img" {
		t.Fatalf("fallback is not the durable copy: %+v", got)
	}
	list, err := s.List()
	if err != nil || len(list) != 1 {
		t.Fatalf("List = %v, %v", list, err)
	}
	if err := s.Delete("v", Durable); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("v"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after Delete: %v", err)
	}
	if _, err := os.Stat(s.durableCopy("v")); !os.IsNotExist(err) {
		t.Fatalf("durable copy left after Delete: %v", err)
	}
}

// TestReadAll: the bytes of every record as Get would read them: a torn
// runtime record gives its durable copy, a corrupt record without one is
// reported and left out, and the rest are there.
func TestReadAll(t *testing.T) {
	s, err := OpenVolumes(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"good", "torn"} {
		if _, err := s.Put(id, &model.Volume{ID: id, Kind: model.KindProvisioned, Image: "/img/" + id}, Durable); err != nil {
			t.Fatal(err)
		}
	}
	torn := &model.Volume{ID: "torn", Kind: model.KindProvisioned, Image: "/img/torn", Stage: &model.Stage{Phase: model.PhaseStaged, StagingPath: "/s"}}
	if _, err := s.Put(torn.ID, torn, Runtime); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(s.path("torn"), []byte(`{"id":"torn","kind":"prov`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.dir, "bad.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	all, err := s.ReadAll()
	if err == nil || !strings.Contains(err.Error(), "bad") {
		t.Fatalf("a corrupt record without a durable copy went unreported: %v", err)
	}
	if len(all) != 2 {
		t.Fatalf("ReadAll = %d records, want good and torn: %q", len(all), all)
	}
	for id, b := range all {
		want, err := s.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		got := &model.Volume{}
		if err := json.Unmarshal(b, got); err != nil || got.ID != want.ID || got.Image != want.Image || (got.Stage == nil) != (want.Stage == nil) {
			t.Fatalf("%s: ReadAll gave %s (%v), Get gives %+v", id, b, err, want)
		}
	}
	if all["torn"] == nil || strings.Contains(string(all["torn"]), "stage") {
		t.Fatalf("torn record: want its durable copy, got %s", all["torn"])
	}
}

// TestSharedStoreMadeAtFirstWrite: a source's shared records of a kind
// never written are none, and leave no directory behind; the first write
// makes it, and the records read back as written.
func TestSharedStoreMadeAtFirstWrite(t *testing.T) {
	state := t.TempDir()
	s, err := Shared(state, "iscsi-session")
	if err != nil {
		t.Fatal(err)
	}
	if keys, err := s.Keys(); err != nil || len(keys) != 0 {
		t.Fatalf("Keys of a kind never written = %v, %v", keys, err)
	}
	if _, err := s.Get("k"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get of a kind never written: %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(filepath.Join(state, "shared")); !os.IsNotExist(err) {
		t.Fatalf("reading made the shared dir: %v", err)
	}
	rec := json.RawMessage(`{"users":["v1"]}`)
	if _, err := s.Put("k", &rec, Durable); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("k")
	if err != nil || string(*got) != string(rec) {
		t.Fatalf("Get = %s, %v; want %s", *got, err, rec)
	}
	if b, err := os.ReadFile(filepath.Join(state, "shared", "iscsi-session", "k.json")); err != nil || string(b) != string(rec) {
		t.Fatalf("file holds %s, %v; want %s", b, err, rec)
	}
	if err := s.Delete("k", Durable); err != nil {
		t.Fatal(err)
	}
	if keys, err := s.Keys(); err != nil || len(keys) != 0 {
		t.Fatalf("Keys after Delete = %v, %v", keys, err)
	}
	if _, err := Shared(state, "../x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a kind that is no file name: %v", err)
	}
}

// TestRecordsListByKey: the mounter's records come back by key, the temp
// file of a write a crash interrupted is removed, and a record that does
// not decode is reported while the others are kept.
func TestRecordsListByKey(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "loops")
	r, err := OpenRecords[map[string]int](dir, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b"} {
		if err := r.Put(k, map[string]int{k: len(k)}); err != nil {
			t.Fatal(err)
		}
	}
	temp := filepath.Join(dir, ".c.json.tmp-123")
	for path, data := range map[string]string{temp: "{", filepath.Join(dir, "bad.json"): "{"} {
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	got, err := r.List()
	if err == nil || !strings.Contains(err.Error(), "bad") {
		t.Fatalf("a record that does not decode went unreported: %v", err)
	}
	if len(got) != 2 || got["a"]["a"] != 1 || got["b"]["b"] != 1 {
		t.Fatalf("List = %v", got)
	}
	if _, err := os.Stat(temp); !os.IsNotExist(err) {
		t.Fatalf("temp file of an interrupted write left: %v", err)
	}
	if err := r.Delete("a"); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.List(); len(got) != 1 {
		t.Fatalf("List after Delete = %v", got)
	}
}
