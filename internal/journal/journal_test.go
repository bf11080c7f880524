package journal

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestPutGetDeleteRoundTrip(t *testing.T) {
	for _, d := range []Durability{Runtime, Durable} {
		testRoundTrip(t, d)
	}
}

func testRoundTrip(t *testing.T, d Durability) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	v := &Volume{ID: "pvc-1", Kind: KindProvisioned, Type: "loop", CapacityBytes: 1 << 20,
		Stage: &Stage{Phase: PhaseStaged, StagingPath: "/s", Source: json.RawMessage(`{"device":"/dev/loop1"}`)},
		Consumers: []Claim{{Consumer: plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 7}},
			Mounts: []plan.Mount{{Type: "ext4", Source: "/dev/loop1", Options: []string{"nosuid", "nodev"}}}}}}
	if err := s.Put(v, d); err != nil {
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

func TestValidIDRejectsPathsAndOddCharacters(t *testing.T) {
	for _, id := range []string{"", "../x", "a/b", ".hidden", "x\x00", "a b", string(make([]byte, 129))} {
		if err := ValidID(id); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ValidID(%q) = %v, want ErrInvalidArgument", id, err)
		}
	}
	for _, id := range []string{"pvc-0b1c", "csi-abc.def_1", "A"} {
		if err := ValidID(id); err != nil {
			t.Errorf("ValidID(%q) = %v", id, err)
		}
	}
}

func TestAtomicWriteLeavesNoTempAndKeepsOldOnFailure(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Put(&Volume{ID: "v", Kind: KindStatic}, Durable); err != nil {
		t.Fatal(err)
	}
	// A directory where the temp file would go makes the next write fail
	// after the old record exists: the old record must survive intact.
	if err := os.Chmod(s.dir, 0o500); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Chmod(s.dir, 0o700) })
	if os.Geteuid() != 0 { // root ignores directory permissions
		if err := s.Put(&Volume{ID: "v", Kind: KindProvisioned}, Durable); err == nil {
			t.Fatal("write into a read-only dir succeeded")
		}
		got, err := s.Get("v")
		if err != nil || got.Kind != KindStatic {
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
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Put(&Volume{ID: "good", Kind: KindStatic}, Durable); err != nil {
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
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	big := &Volume{ID: "v", Kind: KindProvisioned, Image: strings.Repeat("x", 500)}
	small := &Volume{ID: "v", Kind: KindStatic}
	huge := &Volume{ID: "v", Kind: KindEphemeral, Image: strings.Repeat("y", 6000)}
	for i, v := range []*Volume{big, small, big, huge, small} {
		// PutRecord's bytes are what the driver caches and decodes
		// later: they must be the record, not the space-padded file.
		rec, err := s.PutRecord(v, Runtime)
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
		var cached Volume
		if err := json.Unmarshal(rec, &cached); err != nil || cached.Kind != v.Kind || cached.Image != v.Image {
			t.Fatalf("put %d: returned record %.60q (%v), want the volume's JSON", i, rec, err)
		}
	}
}

// A runtime rewrite in place torn by a machine crash must not lose the
// record: the durable copy (what is on disk) takes over.
func TestTornRuntimeRecordFallsBackToDurableCopy(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	v := &Volume{ID: "v", Kind: KindProvisioned, Image: "/img", Format: &Format{FsType: "ext4", Done: true}}
	if err := s.Put(v, Durable); err != nil {
		t.Fatal(err)
	}
	v.Stage = &Stage{Phase: PhaseStaged, StagingPath: "/s"}
	if err := s.Put(v, Runtime); err != nil {
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

// TestClaimJSON: a claim keeps the flat form records have always had, so
// the claims written before an upgrade are read back with their namespace.
func TestClaimJSON(t *testing.T) {
	const old = `{"pid":42,"nsInode":7,"nsId":9,"mountPoint":"/data","mounts":[{"Type":"tmpfs","Source":"t","Target":"","Options":null}]}`
	var c Claim
	if err := json.Unmarshal([]byte(old), &c); err != nil {
		t.Fatal(err)
	}
	want := plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 7, ID: 9}}
	if c.Consumer != want || len(c.Mounts) != 1 {
		t.Fatalf("decoded %+v, want %+v with one mount", c, want)
	}
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"pid", "nsInode", "nsId", "mountPoint", "mounts"} {
		if _, ok := back[k]; !ok {
			t.Errorf("encoded claim %s lacks key %q", b, k)
		}
	}
}

// TestReadAll: the bytes of every record as Get would read them: a torn
// runtime record gives its durable copy, a corrupt record without one is
// reported and left out, and the rest are there.
func TestReadAll(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"good", "torn"} {
		if err := s.Put(&Volume{ID: id, Kind: KindProvisioned, Image: "/img/" + id}, Durable); err != nil {
			t.Fatal(err)
		}
	}
	torn := &Volume{ID: "torn", Kind: KindProvisioned, Image: "/img/torn", Stage: &Stage{Phase: PhaseStaged, StagingPath: "/s"}}
	if err := s.Put(torn, Runtime); err != nil {
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
		got := &Volume{}
		if err := json.Unmarshal(b, got); err != nil || got.ID != want.ID || got.Image != want.Image || (got.Stage == nil) != (want.Stage == nil) {
			t.Fatalf("%s: ReadAll gave %s (%v), Get gives %+v", id, b, err, want)
		}
	}
	if all["torn"] == nil || strings.Contains(string(all["torn"]), "stage") {
		t.Fatalf("torn record: want its durable copy, got %s", all["torn"])
	}
}
