package mounter

import (
	"encoding/binary"
	"errors"
	"os"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// statmount(2) (Linux 6.8) answers about one mount by its unique ID, where
// the propagation check would otherwise read and parse the namespace's
// whole mount table at every Mount: thousands of lines on a busy node,
// for a parent that in a container is almost never shared. x/sys has the
// syscall's number but not its structures; the layouts below are the
// kernel's ABI (include/uapi/linux/mount.h), which only ever grows at the
// end.
const (
	statxMntIDUnique = 0x4000 // STATX_MNT_ID_UNIQUE (Linux 6.8)
	statmountBasic   = 0x2    // STATMOUNT_MNT_BASIC
	msShared         = unix.MS_SHARED

	mntIDReqSize = 24 // MNT_ID_REQ_SIZE_VER0: size, spare, mnt_id, param

	// struct statmount: the fields up to propagate_from (STATMOUNT_MNT_BASIC).
	statmountSize           = 104
	statmountMaskOff        = 8
	statmountPropagationOff = 72
	statmountPeerGroupOff   = 80
)

// noStatmount is set once the kernel has said it has no statmount(2): the
// mount table is read from then on. Tests set it to take that path.
var noStatmount atomic.Bool

// errNoStatmount: the kernel cannot answer; read the mount table instead.
var errNoStatmount = errors.New("statmount(2) not available")

// sharedGroupOf returns the peer group of the mount f lies on when that
// mount is shared, 0 when it is not, asking the kernel about that one
// mount in the calling thread's namespace. errNoStatmount means it cannot
// (a kernel before 6.8, or it did not answer): the caller reads the mount
// table. Run inside the namespace.
func sharedGroupOf(f *os.File) (int, error) {
	if noStatmount.Load() {
		return 0, errNoStatmount
	}
	st, err := statxOf(f, statxMntIDUnique, false)
	if err != nil {
		return 0, err
	}
	if st.Mask&statxMntIDUnique == 0 {
		noStatmount.Store(true)
		return 0, errNoStatmount
	}
	var req [mntIDReqSize]byte
	binary.NativeEndian.PutUint32(req[0:], mntIDReqSize)
	binary.NativeEndian.PutUint64(req[8:], st.Mnt_id)
	binary.NativeEndian.PutUint64(req[16:], statmountBasic)
	var buf [statmountSize]byte
	_, _, errno := unix.Syscall6(unix.SYS_STATMOUNT, uintptr(unsafe.Pointer(&req[0])), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0, 0)
	runtime.KeepAlive(&req)
	runtime.KeepAlive(&buf)
	switch {
	case errno == unix.ENOSYS:
		noStatmount.Store(true)
		return 0, errNoStatmount
	case errno != 0:
		// Refused (EPERM where the caller could not see the mount) or
		// not found: the mount table decides, and says why.
		return 0, errNoStatmount
	case binary.NativeEndian.Uint64(buf[statmountMaskOff:])&statmountBasic == 0:
		return 0, errNoStatmount
	case binary.NativeEndian.Uint64(buf[statmountPropagationOff:])&msShared == 0:
		return 0, nil
	}
	return int(binary.NativeEndian.Uint64(buf[statmountPeerGroupOff:])), nil
}
