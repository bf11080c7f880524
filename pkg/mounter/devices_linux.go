package mounter

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Block device majors of the devices a plan may name.
const (
	loopMajor = 7
	nbdMajor  = 43
)

var (
	nbdName     = regexp.MustCompile(`^nbd[0-9]+$`)
	iscsiInPath = regexp.MustCompile(`/session[0-9]+/`)
)

// openDevice checks that the block device a plan names is one the plugin
// sets up for a staged volume: a loop device whose backing file lies under
// an image root, an NBD device, or a SCSI disk of an iSCSI session. It
// asks the kernel about the device (its numbers, sysfs, the loop driver),
// not the path. Anything else, a host disk first of all, is
// errdefs.ErrPermissionDenied. A loop device is returned open, and the
// caller keeps it open until the mount is built: while it is open the
// kernel defers its detach, so the binding checked is the one mounted.
func (e *Executor) openDevice(p string) (*os.File, error) {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return nil, mountns.Classify(&os.PathError{Op: "stat", Path: p, Err: err})
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return nil, fmt.Errorf("%s is not a block device: %w", p, errdefs.ErrPermissionDenied)
	}
	major, minor := unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev)) //nolint:unconvert // Rdev is uint32 on some architectures
	sys := fmt.Sprintf("/sys/dev/block/%d:%d", major, minor)
	switch major {
	case loopMajor:
		return e.openLoop(p, uint64(st.Rdev), sys) //nolint:unconvert // Rdev is uint32 on some architectures
	case nbdMajor:
		if link, err := os.Readlink(sys); err == nil && nbdName.MatchString(filepath.Base(link)) {
			return nil, nil
		}
		return nil, fmt.Errorf("%s is an NBD partition or unknown, not /dev/nbdN: %w", p, errdefs.ErrPermissionDenied)
	}
	// A SCSI disk's sysfs path runs through its host, and for iSCSI
	// through the session: .../host3/session1/target3:0:0/3:0:0:0/block/sdb.
	if link, err := filepath.EvalSymlinks(sys); err == nil && iscsiInPath.MatchString(link) && strings.Contains(link, "/block/sd") {
		return nil, nil
	}
	return nil, fmt.Errorf("%s (%d:%d) is neither a loop device of a volume image, an NBD device nor an iSCSI disk; "+
		"the mounter mounts no other device: %w", p, major, minor, errdefs.ErrPermissionDenied)
}

// openLoop opens loop device p, which had device number rdev, and checks
// its backing file (checkLoop).
func (e *Executor) openLoop(p string, rdev uint64, sys string) (*os.File, error) {
	// unix.Open and os.NewFile, not os.OpenFile: a device node needs no
	// poller, and os.OpenFile would try it (five more system calls).
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, mountns.Classify(&os.PathError{Op: "open", Path: p, Err: err})
	}
	f := os.NewFile(uintptr(fd), p)
	var st unix.Stat_t
	err = unix.Fstat(int(f.Fd()), &st)
	switch {
	case err != nil:
		err = &os.PathError{Op: "fstat", Path: p, Err: err}
	case uint64(st.Rdev) != rdev: //nolint:unconvert // Rdev is uint32 on some architectures
		err = fmt.Errorf("%s was replaced while it was checked: %w", p, errdefs.ErrPermissionDenied)
	default:
		err = e.checkLoop(f, p, sys)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkLoop accepts a bound loop device whose backing file lies under an
// image root. The path comes from sysfs (the kernel's own, untruncated
// record), and is believed only when the file found there is the one the
// kernel reports for the open device (LOOP_GET_STATUS64: dev and inode).
func (e *Executor) checkLoop(f *os.File, p, sys string) error {
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("%s: LOOP_GET_STATUS64: %w: %w", p, err, errdefs.ErrPermissionDenied)
	}
	b, err := os.ReadFile(filepath.Join(sys, "loop", "backing_file"))
	if err != nil {
		return fmt.Errorf("%s: backing file: %w", p, err)
	}
	backing := strings.TrimSuffix(string(b), "\n")
	var st unix.Stat_t
	if err := unix.Lstat(backing, &st); err != nil || uint64(st.Dev) != info.Device || st.Ino != info.Inode { //nolint:unconvert // Dev is uint32 on some architectures
		return fmt.Errorf("%s: its backing file %q is not visible to the mounter as the same file "+
			"(mount the image roots into the mounter's container): %w", p, backing, errdefs.ErrPermissionDenied)
	}
	if !plan.IsCleanAbs(backing) || !plan.WithinAny(plan.RealPaths(e.Policy.ImageRoots), backing) {
		return fmt.Errorf("%s is backed by %s, which lies under no image root: %w", p, backing, errdefs.ErrPermissionDenied)
	}
	return nil
}
