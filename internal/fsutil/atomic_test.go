package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFileAtomic(t *testing.T) {
	for _, durable := range []bool{false, true} {
		dir := t.TempDir()
		p := filepath.Join(dir, "state.json")
		for _, content := range []string{"first, and longer\n", "second\n"} {
			if err := WriteFileAtomic(p, []byte(content), 0o600, durable); err != nil {
				t.Fatalf("durable=%v: %v", durable, err)
			}
			got, err := os.ReadFile(p)
			if err != nil || string(got) != content {
				t.Fatalf("durable=%v: read %q, %v; want %q", durable, got, err, content)
			}
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("durable=%v: mode %v, want 0600", durable, fi.Mode().Perm())
		}
		assertOnly(t, dir, "state.json")
	}
}

func TestCreateAtomicFailureKeepsOldFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "disk.img")
	if err := WriteFileAtomic(p, []byte("old"), 0o600, true); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := CreateAtomic(p, 0o600, true, func(f *os.File) error {
		if err := f.Truncate(1 << 20); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("got %v, want the fill's error", err)
	}
	if got, _ := os.ReadFile(p); string(got) != "old" {
		t.Fatalf("old file changed to %q", got)
	}
	assertOnly(t, dir, "disk.img")
}

// assertOnly fails unless dir holds exactly the file name (no temp file).
func assertOnly(t *testing.T, dir, name string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != name {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("dir holds %v, want only %s", names, name)
	}
}

// TestAtomicTempsFindsCreateAtomicsTempFiles: the temp file a CreateAtomic
// leaves when its process dies before the rename is listed under the name
// it was to become, and nothing else in the directory is.
func TestAtomicTempsFindsCreateAtomicsTempFiles(t *testing.T) {
	dir := t.TempDir()
	var temp string
	stop := errors.New("the process dies here")
	err := CreateAtomic(filepath.Join(dir, "vol.json"), 0o600, false, func(f *os.File) error {
		temp = f.Name()
		return stop
	})
	if !errors.Is(err, stop) {
		t.Fatalf("CreateAtomic: %v", err)
	}
	// CreateAtomic removed it on error; a killed process would not have.
	for _, name := range []string{filepath.Base(temp), "vol.json", ".vol.json.tmp-", ".vol.json.tmp-x1", "x.tmp-1", "nri", "a", ".t"} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	got, err := AtomicTemps(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || len(got["vol.json"]) != 1 || got["vol.json"][0] != temp {
		t.Fatalf("AtomicTemps = %v, want only vol.json: [%s]", got, temp)
	}
	if got, err := AtomicTemps(filepath.Join(dir, "missing")); err != nil || len(got) != 0 {
		t.Fatalf("AtomicTemps of a missing dir = %v, %v", got, err)
	}
}
