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
