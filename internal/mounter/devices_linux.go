package mounter

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// sourceChecker opens the sources of a plan for the Executor, and refuses
// what the mounter did not set up itself. Local is the one implementation;
// an Executor without one refuses every device and every bind.
type sourceChecker interface {
	// openDevice opens the block device node at p if its device is one
	// the mounter set up and still the same binding; it stays open until
	// the mount is built, so that what was checked is what is mounted.
	openDevice(p string) (*os.File, error)
	// openBindSource opens p (O_PATH, no symlink followed below the state
	// dir) if it is the root of a mount the mounter made, or a directory
	// or file of the state dir's own filesystem that carries no mount.
	openBindSource(p string) (*os.File, error)
}

// Block device majors the mounter sets up.
const (
	loopMajor = 7
	nbdMajor  = 43
)

func (n *Local) openDevice(p string) (*os.File, error) {
	// The node is looked at before it is opened: opening a device the
	// mounter did not set up could already have effects (a tape rewinds).
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return nil, mountns.Classify(&os.PathError{Op: "stat", Path: p, Err: err})
	}
	if err := n.knownDevice(p, st); err != nil {
		return nil, err
	}
	// unix.Open, not os.OpenFile: a device node needs no poller. O_RDONLY:
	// the descriptor only pins and identifies the device.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, mountns.Classify(&os.PathError{Op: "open", Path: p, Err: err})
	}
	f := os.NewFile(uintptr(fd), p)
	if err := n.checkDevice(f, p); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// knownDevice refuses, before it is opened, a node that is no block
// device or whose device the mounter did not set up.
func (n *Local) knownDevice(p string, st unix.Stat_t) error {
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%s is not a block device: %w", p, errdefs.ErrPermissionDenied)
	}
	rdev := uint64(st.Rdev) //nolint:unconvert // Rdev is uint32 on some architectures
	major, minor := unix.Major(rdev), unix.Minor(rdev)
	if (major == loopMajor && n.records.loopByDev(rdev) != nil) || n.ownsNBD(major, minor) || n.ownsISCSI(major, minor) {
		return nil
	}
	return errNotOurs(p, major, minor)
}

func errNotOurs(p string, major, minor uint32) error {
	return fmt.Errorf("%s (%d:%d) is no device the mounter set up (a loop device it attached, an NBD device it connected, a disk of an iSCSI session it logged in); "+
		"it mounts no other: %w", p, major, minor, errdefs.ErrPermissionDenied)
}

// checkDevice accepts an open block device the mounter set up: a loop
// device it attached, still bound to the same file (asked of the open
// device itself: LOOP_GET_STATUS64), an NBD device it connected, or a
// SCSI disk of an iSCSI session it logged in.
func (n *Local) checkDevice(f *os.File, p string) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &os.PathError{Op: "fstat", Path: p, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return fmt.Errorf("%s is not a block device: %w", p, errdefs.ErrPermissionDenied)
	}
	rdev := uint64(st.Rdev) //nolint:unconvert // Rdev is uint32 on some architectures
	major, minor := unix.Major(rdev), unix.Minor(rdev)
	switch {
	case major == loopMajor:
		return n.checkLoop(f, p, rdev)
	case n.ownsNBD(major, minor), n.ownsISCSI(major, minor):
		return nil
	}
	return errNotOurs(p, major, minor)
}

// checkLoop accepts a loop device the mounter holds, bound to the file it
// attached: the kernel's answer for the open device, not its path.
func (n *Local) checkLoop(f *os.File, p string, rdev uint64) error {
	h := n.records.loopByDev(rdev)
	if h == nil {
		return fmt.Errorf("%s is not a loop device the mounter attached: %w", p, errdefs.ErrPermissionDenied)
	}
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("%s: LOOP_GET_STATUS64: %w: %w", p, err, errdefs.ErrPermissionDenied)
	}
	if info.Device != h.rec.Identity.BackingDev || info.Inode != h.rec.Identity.BackingIno {
		return fmt.Errorf("%s is no longer bound to the image the mounter attached (%s): %w", p, h.rec.Image, errdefs.ErrPermissionDenied)
	}
	return nil
}

func (n *Local) openBindSource(p string) (*os.File, error) {
	if !plan.Within(n.opts.StateDir, p) || p == n.opts.StateDir {
		return nil, fmt.Errorf("bind source %s is not below the state dir %s: %w", p, n.opts.StateDir, errdefs.ErrPermissionDenied)
	}
	f, err := n.state.Open(p)
	if err != nil {
		return nil, fmt.Errorf("bind source: %w", err)
	}
	if err := n.checkBindSource(f, p); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkBindSource accepts what lies on a mount the mounter made (a chain's
// layer, a FUSE daemon's mount, the guard: its root, or a directory of the
// volume in it, reached without a symlink), or a file or directory of the
// state dir's own filesystem: one that carries no mount, on itself or on
// the way to it, that the mounter did not make. Anything else (the host's
// /etc bound there by whoever could mount) is refused.
//
// A volume's secrets (their tmpfs) are the mounter's too, and never bound.
func (n *Local) checkBindSource(f *os.File, p string) error {
	if rec, ok := n.records.madeMount(f); ok {
		if !bindable(rec.Kind) {
			return fmt.Errorf("bind source %s is on a %s mount of the mounter's, which is never bound: %w", p, rec.Kind, errdefs.ErrPermissionDenied)
		}
		return nil
	}
	got, _, err := statMount(f)
	if err != nil {
		return err
	}
	root, _, err := statMount(n.state.File())
	if err != nil {
		return err
	}
	if got.Mnt_id == root.Mnt_id && got.Dev_major == root.Dev_major && got.Dev_minor == root.Dev_minor {
		return nil
	}
	return fmt.Errorf("bind source %s carries a mount the mounter did not make: %w", p, errdefs.ErrPermissionDenied)
}
