package journal

import (
	"os"
	"path/filepath"
	"testing"
)

func TestBootRecord(t *testing.T) {
	dir := t.TempDir()
	b := OpenBoot(dir)
	if last, err := b.Last(); err != nil || last != "" {
		t.Fatalf("Last of a new state dir = %q, %v; want none", last, err)
	}
	// A temp file a crash left behind while the record was written.
	stale := filepath.Join(dir, ".boot.tmp-123")
	if err := os.WriteFile(stale, []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"boot-a", "boot-b"} {
		if err := b.Record(id); err != nil {
			t.Fatal(err)
		}
		if last, err := OpenBoot(dir).Last(); err != nil || last != id {
			t.Fatalf("Last = %q, %v; want %q", last, err, id)
		}
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("the temp file of an interrupted write is left: %v", err)
	}
	for _, bad := range []string{"", "a/b", "a\nb"} {
		if err := b.Record(bad); err == nil {
			t.Errorf("Record(%q) is accepted", bad)
		}
	}
}

func TestCurrentBoot(t *testing.T) {
	id, err := CurrentBoot()
	if err != nil {
		t.Fatal(err)
	}
	again, err := CurrentBoot()
	if err != nil || again != id || len(id) != 36 {
		t.Fatalf("CurrentBoot = %q then %q, %v; want one UUID", id, again, err)
	}
}

func TestBootFrom(t *testing.T) {
	p := filepath.Join(t.TempDir(), "boot_id")
	if _, err := BootFrom(p)(); err == nil {
		t.Fatal("a missing boot ID file reads")
	}
	if err := os.WriteFile(p, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := BootFrom(p)(); err == nil {
		t.Fatal("an empty boot ID reads")
	}
	if err := os.WriteFile(p, []byte("played-boot\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if id, err := BootFrom(p)(); err != nil || id != "played-boot" {
		t.Fatalf("BootFrom = %q, %v", id, err)
	}
}
