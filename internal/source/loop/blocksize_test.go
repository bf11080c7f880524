package loop

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
)

// TestFsBlockSize reads the unit a loop device must keep for the image's
// filesystem from hand-made superblocks; anything else asks for none.
func TestFsBlockSize(t *testing.T) {
	ext := func(logBlock uint32) []byte {
		b := make([]byte, 4096)
		binary.LittleEndian.PutUint32(b[extLogBlock:], logBlock)
		binary.LittleEndian.PutUint16(b[extMagicOff:], extMagic)
		return b
	}
	xfs := func(sect uint16) []byte {
		b := make([]byte, 4096)
		copy(b, "XFSB")
		binary.BigEndian.PutUint16(b[xfsSectSize:], sect)
		return b
	}
	for _, tc := range []struct {
		name  string
		image []byte
		want  uint32
	}{
		{"ext4 of 1 KiB blocks", ext(0), 1024},
		{"ext4 of 4 KiB blocks", ext(2), 4096},
		{"ext4 of 64 KiB blocks (beyond a loop device's)", ext(6), 0},
		{"ext4 with a nonsense block size", ext(40), 0},
		{"xfs of 512-byte sectors", xfs(512), 512},
		{"xfs of 4 KiB sectors", xfs(4096), 4096},
		{"xfs with a sector size not a power of two", xfs(1536), 0},
		{"blank", make([]byte, 4096), 0},
		{"shorter than a superblock", []byte("XFSB"), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(p, tc.image, 0o600); err != nil {
				t.Fatal(err)
			}
			if got := fsBlockSize(p); got != tc.want {
				t.Errorf("fsBlockSize = %d, want %d", got, tc.want)
			}
		})
	}
	if got := fsBlockSize(filepath.Join(t.TempDir(), "missing")); got != 0 {
		t.Errorf("fsBlockSize of a missing image = %d, want 0", got)
	}
}

// TestBlockSizeRemembered: a stage of an image staged before takes its
// block size from memory while the image is the same file at the same
// size, and reads the superblock again when it is not, when the last
// read found none, and after a stage for block access.
func TestBlockSizeRemembered(t *testing.T) {
	ext := func(logBlock uint32, size int) []byte {
		b := make([]byte, size)
		binary.LittleEndian.PutUint32(b[extLogBlock:], logBlock)
		binary.LittleEndian.PutUint16(b[extMagicOff:], extMagic)
		return b
	}
	p := filepath.Join(t.TempDir(), "img")
	write := func(b []byte) { // in place: same inode
		t.Helper()
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(b, 0); err != nil {
			t.Fatal(err)
		}
	}
	var c blockSizes
	check := func(step string, want uint32) {
		t.Helper()
		if got := c.get(p); got != want {
			t.Fatalf("%s: block size %d, want %d", step, got, want)
		}
	}
	write(make([]byte, 8192))
	check("blank", 0)
	write(ext(2, 8192))
	check("formatted in place after a blank read (not remembered)", 4096)
	// The superblock changes under the same file and size: the memory
	// answers, which shows the read is skipped.
	write(ext(0, 8192))
	check("same file, same size", 4096)
	c.forget(p)
	check("after forget (a stage for block access)", 1024)
	write(ext(2, 12288))
	check("grown in place", 4096)
	// A new file at the same path (a restore or a clone writes one).
	tmp := p + ".new"
	if err := os.WriteFile(tmp, ext(0, 12288), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, p); err != nil {
		t.Fatal(err)
	}
	check("another file at the path", 1024)
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	check("missing", 0)
}
