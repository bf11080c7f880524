// Package loopdev attaches, adopts and detaches loop devices with the loop
// ioctls directly (LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LOOP_CLR_FD), without
// fork/exec of losetup.
//
// A Device holds an open file descriptor of its /dev/loopN for as long as the
// caller keeps it. Two kernel rules make that descriptor the anchor of the
// device's lifetime:
//
//   - With Autoclear the kernel detaches the device when its last opener
//     (a held fd or a mount) goes away. The plugin keeps each staged volume's
//     Device open, so the device lives until unstage, or until the plugin dies
//     and nothing mounts it: no loop device outlives both.
//   - LOOP_CLR_FD never detaches a device that someone else still holds: it
//     only marks it autoclear. While a Device holds its fd, the loop number
//     cannot be cleared and handed to another backing file, so the identity
//     checked at Attach stays true until Close.
//
// Once the fd is closed (Close, or a new process that only has a journal
// record), a loop number may be reused within milliseconds. Adopt and Detach
// therefore check the device's Identity against the kernel before they trust
// or touch it.
package loopdev

import (
	"os"
	"sync"
)

// Options selects how Attach configures the device.
type Options struct {
	// ReadOnly attaches the device read-only (LO_FLAGS_READ_ONLY); the
	// backing file is opened O_RDONLY.
	ReadOnly bool
	// DirectIO asks for direct I/O on the backing file, which avoids double
	// caching of the image in the host page cache. Attach falls back to
	// buffered I/O when the backing filesystem refuses O_DIRECT;
	// Device.DirectIO tells what the kernel actually does.
	DirectIO bool
	// Autoclear lets the kernel detach the device when its last opener
	// closes it (LO_FLAGS_AUTOCLEAR).
	Autoclear bool
	// BlockSize is the device's logical block size (0: the kernel's
	// choice, which with direct I/O is the backing file's direct I/O
	// alignment: 4096 for a reflinked file on xfs). A filesystem made with
	// smaller blocks or sectors does not mount on a device with larger
	// ones; asking for its size keeps it mountable, and the kernel drops
	// direct I/O when the size is below the alignment.
	BlockSize uint32
	// Prefer, when set, is the loop number to try first: a device being
	// attached again at the number it had before (the mounter restoring
	// what it held), so that records naming it stay true.
	Prefer *int
}

// Identity names a loop device binding: the device numbers of /dev/loopN
// and the st_dev/st_ino of its backing file. The pair survives a restart of
// the plugin and tells a reused loop number from the one that was recorded.
type Identity struct {
	Major, Minor uint32
	BackingDev   uint64
	BackingIno   uint64
}

// Device is a bound loop device with an open fd.
type Device struct {
	Path     string // /dev/loopN
	Number   int
	Identity Identity
	// DirectIO tells whether direct I/O is in effect, as read back from the
	// kernel (the status flags, which /sys/block/loopN/loop/dio mirrors).
	DirectIO bool
	ReadOnly bool

	// mu serialises the methods: Detach and Close swap f out.
	mu sync.Mutex
	f  *os.File // /dev/loopN, O_RDONLY|O_CLOEXEC; nil once closed
}
