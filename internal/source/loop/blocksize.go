package loop

import (
	"encoding/binary"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Superblock fields that say the smallest unit of I/O a filesystem was
// made for: ext2/3/4's block size (1024 << s_log_block_size, at 24 in the
// superblock at 1024, magic 0xEF53 at 56) and xfs's sector size
// (sb_sectsize, big-endian at 102, magic "XFSB" at 0).
const (
	extSuperblock = 1024
	extLogBlock   = extSuperblock + 24
	extMagicOff   = extSuperblock + 56
	extMagic      = 0xEF53
	xfsSectSize   = 102
)

// fsBlockSize reads the image's superblock for the logical block size its
// loop device must not exceed, 0 when the image holds neither ext4 nor xfs
// (blank: mkfs will fit the device) or cannot be read. The loop device of
// a volume must keep the block size its filesystem was made on: after a
// reflink copy the image's direct I/O alignment on xfs is 4096, and the
// kernel's default would make an ext4 of 1 KiB blocks (mke2fs's choice
// below 512 MiB) or an xfs of 512-byte sectors unmountable.
func fsBlockSize(image string) uint32 {
	sb := superblock(image)
	if sb == nil {
		return 0
	}
	var size uint32
	switch {
	case string(sb[:4]) == "XFSB":
		size = uint32(binary.BigEndian.Uint16(sb[xfsSectSize:]))
	case binary.LittleEndian.Uint16(sb[extMagicOff:]) == extMagic:
		if log := binary.LittleEndian.Uint32(sb[extLogBlock:]); log <= 6 {
			size = 1024 << log
		}
	}
	// A loop device takes 512 to 4096 (the page size) in powers of two.
	if size < 512 || size > 4096 || size&(size-1) != 0 {
		return 0
	}
	return size
}

// blockSizes remembers fsBlockSize of images that held a filesystem, so
// that a stage of a volume staged before does not read its superblock
// again: the loop device writes the image with direct I/O, which drops
// the image's cached pages, so every such read goes to the disk (about
// 0.15 ms, a tenth of a publish cycle's own work). An entry holds only
// while the image is the same file at the same size (inode, birth time
// and size, by one statx): a restore or clone writes a new file, a
// format happens only on a blank image (never cached), and an expansion
// changes the size; a stage for block access, whose consumer may make
// another filesystem, forgets the entry. An image whose birth time the filesystem does not
// report is read every time.
type blockSizes struct {
	mu sync.Mutex
	m  map[string]imageBlockSize
}

type imageBlockSize struct {
	ino, size uint64
	btime     unix.StatxTimestamp
	blockSize uint32
}

// get returns fsBlockSize(image), from memory when image is unchanged.
func (c *blockSizes) get(image string) uint32 {
	var stx unix.Statx_t
	const want = unix.STATX_INO | unix.STATX_SIZE | unix.STATX_BTIME
	if err := unix.Statx(unix.AT_FDCWD, image, unix.AT_STATX_SYNC_AS_STAT, want, &stx); err != nil || stx.Mask&want != want {
		return fsBlockSize(image)
	}
	key := imageBlockSize{ino: stx.Ino, size: stx.Size, btime: stx.Btime}
	c.mu.Lock()
	e, ok := c.m[image]
	c.mu.Unlock()
	if ok && e.ino == key.ino && e.size == key.size && e.btime == key.btime {
		return e.blockSize
	}
	key.blockSize = fsBlockSize(image)
	c.mu.Lock()
	defer c.mu.Unlock()
	if key.blockSize == 0 { // blank or unreadable: mkfs may change that
		delete(c.m, image)
		return 0
	}
	if c.m == nil {
		c.m = map[string]imageBlockSize{}
	}
	c.m[image] = key
	return key.blockSize
}

func (c *blockSizes) forget(image string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, image)
}

// superblock reads the first 2 KiB of image (where ext4's and xfs's
// superblocks are), nil when it cannot.
func superblock(image string) []byte {
	f, err := os.Open(image)
	if err != nil {
		return nil
	}
	defer f.Close()
	sb := make([]byte, extSuperblock+1024)
	if _, err := f.ReadAt(sb, 0); err != nil {
		return nil
	}
	return sb
}

// isXFS tells whether image begins with an xfs superblock.
func isXFS(image string) bool {
	sb := superblock(image)
	return sb != nil && string(sb[:4]) == "XFSB"
}
