package guard

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path"
	"sync"

	"golang.org/x/sys/unix"
)

// The guard's filesystem speaks just enough of the FUSE protocol
// (linux/fuse.h) to exist: a read-only root directory in which every name
// is a directory too, all empty, whose attributes anyone may read and that
// nobody may list or write (they open, as kubelet opens a target to walk
// a subPath from it, with nothing to read). No attribute or name is cached
// by the kernel, so once the connection is gone even a stat fails.
//
// Every name exists because a publish binds the directory named after its
// target (Dir), and kubelet, preparing a subPath of a volume, stats the
// subPath below the target and binds it only if it is there: the hook
// then finds out, from the guard's own record of the names it gave out
// (tree.pathOf), which volume and which subPath a container's bind is.

const (
	fuseLookup      = 1
	fuseForget      = 2
	fuseGetattr     = 3
	fuseStatfs      = 17
	fuseInit        = 26
	fuseOpendir     = 27
	fuseReaddir     = 28
	fuseReleasedir  = 29
	fuseInterrupt   = 36
	fuseDestroy     = 38
	fuseBatchForget = 42

	fuseRootID    = 1
	fuseInHeader  = 40 // len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
	fuseOutHeader = 16 // len, error, unique
	fuseAttrSize  = 88
	fuseEntryOut  = 40 + fuseAttrSize // nodeid, generation, entry_valid, attr_valid, their nsecs, attr
	fuseMinor     = 31
	fuseMaxWrite  = 128 << 10
	fuseBufSize   = fuseMaxWrite + 4096

	// maxNodes bounds the names the guard remembers at once: kubelet's
	// look-ups are a few per subPath, and only root on the node reaches
	// the guard at all.
	maxNodes = 1 << 16
	// maxDepth bounds a name's depth below the root.
	maxDepth = 64
)

// tree is what the guard has named: each node the kernel holds (it looked
// it up and has not forgotten it), by ID, with its parent and name. A
// node's ID is its inode number.
type tree struct {
	mu     sync.Mutex
	nodes  map[uint64]*node
	byName map[nodeKey]uint64
	next   uint64
}

type node struct {
	key     nodeKey
	depth   int
	lookups uint64 // the kernel's count of references (FORGET takes them back)
}

type nodeKey struct {
	parent uint64
	name   string
}

func newTree() *tree {
	return &tree{nodes: map[uint64]*node{}, byName: map[nodeKey]uint64{}, next: fuseRootID + 1}
}

// lookup returns the ID of name in parent, one more reference to it.
func (t *tree) lookup(parent uint64, name string) (uint64, unix.Errno) {
	t.mu.Lock()
	defer t.mu.Unlock()
	depth := 0
	if parent != fuseRootID {
		p, ok := t.nodes[parent]
		if !ok {
			return 0, unix.ENOENT
		}
		depth = p.depth
	}
	switch {
	case !validName(name) || len(name) > unix.NAME_MAX:
		return 0, unix.ENOENT
	case depth >= maxDepth:
		return 0, unix.ENAMETOOLONG
	}
	k := nodeKey{parent, name}
	id, ok := t.byName[k]
	if !ok {
		if len(t.nodes) >= maxNodes {
			return 0, unix.ENOSPC
		}
		id = t.next
		t.next++
		t.byName[k] = id
		t.nodes[id] = &node{key: k, depth: depth + 1}
	}
	t.nodes[id].lookups++
	return id, 0
}

// forget takes n references to id back; with none left it is forgotten.
func (t *tree) forget(id, n uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	nd, ok := t.nodes[id]
	if !ok {
		return
	}
	if nd.lookups > n {
		nd.lookups -= n
		return
	}
	delete(t.nodes, id)
	delete(t.byName, nd.key)
}

func (t *tree) known(id uint64) bool {
	if id == fuseRootID {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.nodes[id]
	return ok
}

// pathOf returns the path of node id below the root ("" for the root).
func (t *tree) pathOf(id uint64) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var names []string
	for id != fuseRootID {
		nd, ok := t.nodes[id]
		if !ok {
			return "", false
		}
		names = append(names, nd.key.name)
		id = nd.key.parent
	}
	for i, j := 0, len(names)-1; i < j; i, j = i+1, j-1 {
		names[i], names[j] = names[j], names[i]
	}
	return path.Join(names...), true
}

// serveFuse answers requests on dev until the connection ends (the file is
// closed, or the filesystem unmounted everywhere).
func (t *tree) serveFuse(dev *os.File) {
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
		if reply := t.answer(buf[:n]); reply != nil {
			if _, err := dev.Write(reply); errors.Is(err, os.ErrClosed) || errors.Is(err, unix.ENODEV) {
				return
			}
		}
	}
}

// answer returns the reply to one request, or nil for requests that take
// none.
func (t *tree) answer(req []byte) []byte {
	le := binary.LittleEndian
	opcode, unique, id := le.Uint32(req[4:]), le.Uint64(req[8:]), le.Uint64(req[16:])
	body := req[fuseInHeader:]
	switch opcode {
	case fuseForget:
		if len(body) >= 8 {
			t.forget(id, le.Uint64(body))
		}
		return nil
	case fuseBatchForget:
		if len(body) >= 8 {
			count := int(le.Uint32(body))
			for i := 0; i < count && 8+16*(i+1) <= len(body); i++ {
				one := body[8+16*i:]
				t.forget(le.Uint64(one), le.Uint64(one[8:]))
			}
		}
		return nil
	case fuseInterrupt:
		return nil
	case fuseInit:
		return reply(unique, 0, initOut(body))
	case fuseGetattr:
		if !t.known(id) {
			return reply(unique, unix.ENOENT, nil)
		}
		out := make([]byte, 16+fuseAttrSize) // attr_valid 0: never cached
		putDirAttr(out[16:], id)
		return reply(unique, 0, out)
	case fuseStatfs:
		out := make([]byte, 80)
		le.PutUint32(out[40:], 4096) // bsize
		le.PutUint32(out[44:], 255)  // namelen
		le.PutUint32(out[48:], 4096) // frsize
		return reply(unique, 0, out)
	case fuseLookup:
		name, _, _ := bytes.Cut(body, []byte{0})
		child, errno := t.lookup(id, string(name))
		if errno != 0 {
			return reply(unique, errno, nil)
		}
		out := make([]byte, fuseEntryOut) // entry_valid, attr_valid 0: never cached
		le.PutUint64(out[0:], child)
		putDirAttr(out[40:], child)
		return reply(unique, 0, out)
	case fuseOpendir:
		if !t.known(id) {
			return reply(unique, unix.ENOENT, nil)
		}
		return reply(unique, 0, make([]byte, 16)) // fuse_open_out: handle 0, no flags
	case fuseReaddir:
		return reply(unique, unix.EACCES, nil)
	case fuseReleasedir, fuseDestroy:
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

// putDirAttr fills a fuse_attr for node id: a directory, mode 0555,
// owned by root.
func putDirAttr(b []byte, id uint64) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], id)                  // ino
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
