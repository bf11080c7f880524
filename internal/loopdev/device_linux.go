package loopdev

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// withFd runs fn with f's descriptor through SyscallConn, so the fd cannot
// be closed and reused under fn.
func withFd(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var opErr error
	if err := rc.Control(func(fd uintptr) { opErr = fn(int(fd)) }); err != nil {
		return err
	}
	return opErr
}

// status reads LOOP_GET_STATUS64 and the device numbers of f.
// ENXIO from the ioctl means the device is not bound.
func status(f *os.File) (info *unix.LoopInfo64, rdev uint64, err error) {
	err = withFd(f, func(fd int) error {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFBLK {
			return unix.ENOTTY
		}
		rdev = uint64(st.Rdev)
		info, err = unix.IoctlLoopGetStatus64(fd)
		return err
	})
	return info, rdev, err
}

// newDevice builds a Device for an open, bound loop device from what the
// kernel reports. It takes ownership of f only on success.
func newDevice(f *os.File, path string) (*Device, error) {
	info, rdev, err := status(f)
	if err != nil {
		return nil, sysErr("LOOP_GET_STATUS64", path, err)
	}
	d := &Device{
		Path:   path,
		Number: int(info.Number),
		Identity: Identity{
			Major:      unix.Major(rdev),
			Minor:      unix.Minor(rdev),
			BackingDev: info.Device,
			BackingIno: info.Inode,
		},
		ReadOnly: info.Flags&unix.LO_FLAGS_READ_ONLY != 0,
		f:        f,
	}
	// The kernel keeps LO_FLAGS_DIRECT_IO in step with what the device
	// does (it clears the flag when the backing file cannot do direct
	// I/O), and sysfs loop/dio shows the same bit: no need to read it
	// there too (TestDirectIO compares the two).
	d.DirectIO = info.Flags&unix.LO_FLAGS_DIRECT_IO != 0
	return d, nil
}

// matches tells whether the device behind f is still the binding named by
// want. An unbound device (ENXIO) does not match and is no error.
func matches(f *os.File, want Identity) (bool, error) {
	info, rdev, err := status(f)
	if errors.Is(err, unix.ENXIO) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return unix.Major(rdev) == want.Major && unix.Minor(rdev) == want.Minor &&
		info.Device == want.BackingDev && info.Inode == want.BackingIno, nil
}

// Adopt reopens an existing loop device, for instance one recorded in the
// journal before a restart. It returns errdefs.ErrNotFound when path is
// absent, not a loop device, unbound, or bound to another file than want.
func Adopt(path string, want Identity) (*Device, error) {
	if want.BackingIno == 0 {
		return nil, fmt.Errorf("loopdev: adopt %s: empty identity: %w", path, errdefs.ErrInvalidArgument)
	}
	f, err := openDevice(path)
	if err != nil {
		return nil, err
	}
	// One status query both builds the Device and proves its identity.
	d, err := newDevice(f, path)
	if err != nil || d.Identity != want {
		f.Close()
		// ENXIO: unbound; ENOTTY: not a loop device.
		if err != nil && !errors.Is(err, unix.ENXIO) && !errors.Is(err, unix.ENOTTY) {
			return nil, err
		}
		return nil, fmt.Errorf("loopdev: adopt %s: not bound to %d:%d: %w",
			path, want.BackingDev, want.BackingIno, errdefs.ErrNotFound)
	}
	return d, nil
}

// openDevice opens a loop device node for holding and status queries. A
// node that does not exist or whose device is gone yields (nil, ErrNotFound).
func openDevice(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, sysErr("open", path, err)
	}
	return f, nil
}

// FindByBacking returns, opened, every loop device whose backing file is
// backingFile's dev:ino. The path the kernel shows in backing_file is not
// trusted: the same image may be reached through another path, and a path
// may since name another file. ErrNotFound if backingFile does not exist.
func FindByBacking(backingFile string) (found []*Device, err error) {
	var st unix.Stat_t
	if err := unix.Stat(backingFile, &st); err != nil {
		return nil, sysErr("stat", backingFile, err)
	}
	numbers, err := boundNumbers()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			closeAll(found)
			found = nil
		}
	}()
	for _, n := range numbers {
		d, err := openIfBacking(n, uint64(st.Dev), st.Ino)
		if err != nil {
			return found, err
		}
		if d != nil {
			found = append(found, d)
		}
	}
	return found, nil
}

func openIfBacking(n int, dev, ino uint64) (*Device, error) {
	path := "/dev/loop" + strconv.Itoa(n)
	f, err := openDevice(path)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil // removed since the listing
	}
	if err != nil {
		return nil, err
	}
	d, err := newDevice(f, path)
	if err != nil || d.Identity.BackingDev != dev || d.Identity.BackingIno != ino {
		f.Close()
		if errors.Is(err, unix.ENXIO) {
			err = nil // detached since the listing
		}
		return nil, err
	}
	return d, nil
}

// boundNumbers lists loop devices that sysfs shows bound: only a bound
// device has a loop/ directory. Unbound devices are never opened.
func boundNumbers() ([]int, error) {
	entries, err := os.ReadDir("/sys/block")
	if err != nil {
		return nil, sysErr("readdir", "/sys/block", err)
	}
	var ns []int
	for _, e := range entries {
		n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "loop"))
		if err != nil || !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if _, err := os.Stat("/sys/block/" + e.Name() + "/loop/backing_file"); err == nil {
			ns = append(ns, n)
		}
	}
	return ns, nil
}

func closeAll(ds []*Device) {
	for _, d := range ds {
		d.Close()
	}
}
