package loopdev

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Detach unbinds the device if, and only if, the kernel still reports the
// recorded Identity, then closes the fd. A device already gone or now bound
// to another file is left alone and Detach returns nil: a loop number is
// reused within milliseconds, and detaching someone else's volume is the
// one mistake this package exists to prevent.
//
// LOOP_CLR_FD does not unbind while others hold the device (a mount, a
// probing blkid): the kernel marks it autoclear and unbinds at the last
// close. Detach therefore returns before the device is gone when it is
// still mounted; unmount first for a synchronous detach.
func (d *Device) Detach() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	f := d.f
	d.f = nil
	if f == nil {
		// Closed before (or adopted by value): reopen to check and clear.
		var err error
		if f, err = openDevice(d.Path); err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				return nil
			}
			return err
		}
	}
	ok, err := matches(f, d.Identity)
	if err != nil || !ok {
		f.Close()
		if err != nil {
			return sysErr("LOOP_GET_STATUS64", d.Path, err)
		}
		return nil
	}
	err = withFd(f, func(fd int) error { return unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0) })
	// The unbind happens in the kernel's release of the last opener, which
	// may be this close.
	cerr := f.Close()
	if err != nil && !errors.Is(err, unix.ENXIO) {
		return sysErr("LOOP_CLR_FD", d.Path, err)
	}
	if err == nil {
		hintFree(d.Number)
	}
	return cerr
}

// Close closes the held fd only. With Autoclear, the kernel unbinds the
// device when this was its last opener (no mount uses it).
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.f == nil {
		return nil
	}
	err := d.f.Close()
	d.f = nil
	return err
}

// SetCapacity makes the kernel re-read the backing file's size after it
// grew (LOOP_SET_CAPACITY). The held fd is read-only, so this relies on
// CAP_SYS_ADMIN, which the plugin has for any loop work.
func (d *Device) SetCapacity() error {
	return d.ioctl("LOOP_SET_CAPACITY", func(fd int) error {
		return unix.IoctlSetInt(fd, unix.LOOP_SET_CAPACITY, 0)
	})
}

// Size returns the device's size in bytes (BLKGETSIZE64).
func (d *Device) Size() (int64, error) {
	var size uint64
	err := d.ioctl("BLKGETSIZE64", func(fd int) (err error) {
		size, err = unix.IoctlGetUint64(fd, unix.BLKGETSIZE64)
		return err
	})
	return int64(size), err
}

// ioctl runs fn on the held fd. The identity need not be re-checked: while
// the fd is held, the kernel cannot unbind the device and give the number
// to another file.
func (d *Device) ioctl(op string, fn func(fd int) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.f == nil {
		return fmt.Errorf("loopdev: %s %s: device closed: %w", op, d.Path, errdefs.ErrFailedPrecondition)
	}
	if err := withFd(d.f, fn); err != nil {
		return sysErr(op, d.Path, err)
	}
	return nil
}
