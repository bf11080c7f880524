package imagecopy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCopyKeepsDataAndHoles copies a sparse file holding two data extents
// and checks the copy byte for byte, its size, and (on a filesystem
// without reflink) that only the data was allocated.
func TestCopyKeepsDataAndHoles(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src.img")
	const size = 64 << 20
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	a, b := bytes.Repeat([]byte("a"), 1<<20), bytes.Repeat([]byte("b"), 3<<20)
	if _, err := f.WriteAt(a, 4<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(b, 40<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()

	dst := filepath.Join(dir, "copies", "dst.img")
	method, err := File(context.Background(), src, dst, Options{Size: size + 16<<20})
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != size+16<<20 {
		t.Fatalf("copy is %d bytes, want %d (grown to the asked size)", len(got), size+16<<20)
	}
	want := make([]byte, size+16<<20)
	copy(want[4<<20:], a)
	copy(want[40<<20:], b)
	if !bytes.Equal(got, want) {
		t.Fatal("the copy's content differs from the source's")
	}
	alloc, err := allocated(dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("method %s, %d bytes allocated", method, alloc)
	if method == Sparse && alloc > 8<<20 {
		t.Errorf("a sparse copy of 4 MiB of data allocated %d bytes: holes were filled", alloc)
	}
	if _, err := File(context.Background(), src, dst, Options{}); !errors.Is(err, os.ErrExist) {
		t.Errorf("a copy over an existing file: %v, want ErrExist", err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(dst)); len(ents) != 1 {
		t.Errorf("the copy's directory holds %d entries, want only the copy (no temp file)", len(ents))
	}
}

// TestCancelledCopyStops: the sparse copy stops at a cancelled context
// (File then removes its temp file, as for any error).
func TestCancelledCopyStops(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src.img")
	if err := os.WriteFile(src, bytes.Repeat([]byte("x"), 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(filepath.Join(dir, "dst.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := sparseCopy(ctx, in, out, 1<<20); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled copy: %v, want context.Canceled", err)
	}
}

// allocated is how many bytes of the disk a file uses (its data extents):
// what a sparse copy of it writes.
func allocated(path string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Blocks * 512, nil
}
