package guard

import (
	"encoding/binary"
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// The guard's filesystem speaks just enough of the FUSE protocol
// (linux/fuse.h) to exist: one read-only, empty root directory whose
// attributes anyone may read and that nobody may open, list or write. No
// attribute or name is cached by the kernel, so once the connection is gone
// even a stat fails.

const (
	fuseLookup      = 1
	fuseForget      = 2
	fuseGetattr     = 3
	fuseStatfs      = 17
	fuseInit        = 26
	fuseOpendir     = 27
	fuseInterrupt   = 36
	fuseDestroy     = 38
	fuseBatchForget = 42

	fuseRootID    = 1
	fuseInHeader  = 40 // len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
	fuseOutHeader = 16 // len, error, unique
	fuseAttrSize  = 88
	fuseMinor     = 31
	fuseMaxWrite  = 128 << 10
	fuseBufSize   = fuseMaxWrite + 4096
)

// serveFuse answers requests on dev until the connection ends (the file is
// closed, or the filesystem unmounted everywhere).
func serveFuse(dev *os.File) {
	buf := make([]byte, fuseBufSize)
	for {
		n, err := dev.Read(buf)
		switch {
		case errors.Is(err, unix.ENOENT), errors.Is(err, unix.EINTR):
			continue // the request was interrupted before we read it
		case err != nil:
			return // ENODEV: unmounted; os.ErrClosed: aborted by us
		case n < fuseInHeader:
			continue
		}
		if reply := answer(buf[:n]); reply != nil {
			if _, err := dev.Write(reply); errors.Is(err, os.ErrClosed) || errors.Is(err, unix.ENODEV) {
				return
			}
		}
	}
}

// answer returns the reply to one request, or nil for requests that take
// none.
func answer(req []byte) []byte {
	le := binary.LittleEndian
	opcode, unique, node := le.Uint32(req[4:]), le.Uint64(req[8:]), le.Uint64(req[16:])
	body := req[fuseInHeader:]
	switch opcode {
	case fuseForget, fuseBatchForget, fuseInterrupt:
		return nil
	case fuseInit:
		return reply(unique, 0, initOut(body))
	case fuseGetattr:
		if node != fuseRootID {
			return reply(unique, unix.ENOENT, nil)
		}
		out := make([]byte, 16+fuseAttrSize) // attr_valid 0: never cached
		putRootAttr(out[16:])
		return reply(unique, 0, out)
	case fuseStatfs:
		out := make([]byte, 80)
		le.PutUint32(out[40:], 4096) // bsize
		le.PutUint32(out[44:], 255)  // namelen
		le.PutUint32(out[48:], 4096) // frsize
		return reply(unique, 0, out)
	case fuseLookup:
		return reply(unique, unix.ENOENT, nil)
	case fuseOpendir:
		return reply(unique, unix.EACCES, nil)
	case fuseDestroy:
		return reply(unique, 0, nil)
	default:
		// Anything else (open, xattrs, and writes the read-only mount
		// never lets through) is refused. ENOSYS would be remembered by
		// the kernel as "not implemented" and, for access(2), as allowed.
		return reply(unique, unix.EACCES, nil)
	}
}

// initOut is fuse_init_out for protocol 7.31 (64 bytes): no optional
// feature is asked for.
func initOut(in []byte) []byte {
	le := binary.LittleEndian
	out := make([]byte, 64)
	le.PutUint32(out[0:], 7)
	le.PutUint32(out[4:], fuseMinor)
	if len(in) >= 12 {
		le.PutUint32(out[8:], le.Uint32(in[8:])) // max_readahead as offered
	}
	le.PutUint16(out[16:], 1)                // max_background
	le.PutUint16(out[18:], 1)                // congestion_threshold
	le.PutUint32(out[20:], fuseMaxWrite)     // max_write
	le.PutUint32(out[24:], 1)                // time_gran
	le.PutUint16(out[28:], fuseMaxWrite>>12) // max_pages
	return out
}

// putRootAttr fills a fuse_attr for the root: a directory, mode 0555,
// owned by root.
func putRootAttr(b []byte) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], fuseRootID)          // ino
	le.PutUint32(b[60:], unix.S_IFDIR|0o555) // mode
	le.PutUint32(b[64:], 2)                  // nlink
	le.PutUint32(b[80:], 4096)               // blksize
}

func reply(unique uint64, errno unix.Errno, body []byte) []byte {
	le := binary.LittleEndian
	out := make([]byte, fuseOutHeader+len(body))
	le.PutUint32(out[0:], uint32(len(out)))
	le.PutUint32(out[4:], uint32(-int32(errno)))
	le.PutUint64(out[8:], unique)
	copy(out[fuseOutHeader:], body)
	return out
}
