package loopdev

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
)

const loopControl = "/dev/loop-control"

// maxAttempts bounds the LOOP_CTL_GET_FREE/LOOP_CONFIGURE loop. Every
// EBUSY means another attacher won that number, so each retry makes
// progress; 64 covers many concurrent attachers on one node.
const maxAttempts = 64

// Attach binds backingFile to a free loop device and returns it opened.
func Attach(ctx context.Context, backingFile string, o Options) (*Device, error) {
	return AttachWith(ctx, backingFile, o, func(flags int) (*os.File, error) { return os.OpenFile(backingFile, flags, 0) })
}

// AttachWith is Attach with the backing file opened by open, called with
// the open(2) flags Attach wants (read-only or read-write, O_DIRECT first
// when asked): a caller that must not follow a symlink opens it its own
// way. name names the file in errors and in the device's lo_file_name.
func AttachWith(ctx context.Context, name string, o Options, open func(flags int) (*os.File, error)) (*Device, error) {
	if name == "" {
		return nil, fmt.Errorf("loopdev: attach: empty backing file: %w", errdefs.ErrInvalidArgument)
	}
	backing, dio, err := openBacking(ctx, name, o, open)
	if err != nil {
		return nil, err
	}
	backingFile := name
	// The kernel takes its own reference to the file in LOOP_CONFIGURE.
	defer backing.Close()

	ctl, err := os.OpenFile(loopControl, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, sysErr("open", loopControl, err)
	}
	defer ctl.Close()

	if o.Prefer != nil {
		hintFree(*o.Prefer)
	}
	if d := attachHinted(ctx, backing, backingFile, o, dio); d != nil {
		return d, nil
	}
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("loopdev: attach %s: %w", backingFile, err)
		}
		d, err := attachOnce(ctl, backing, backingFile, o, dio)
		if err == nil {
			logDirectIO(ctx, d, o)
			return d, nil
		}
		if !retryable(err) {
			return nil, err
		}
		if attempt == maxAttempts {
			return nil, fmt.Errorf("loopdev: attach %s: gave up after %d attempts: %w", backingFile, attempt, err)
		}
	}
}

// attachHinted tries the numbers this process detached last (see
// hintFree) before LOOP_CTL_GET_FREE. It returns nil when none of them
// could be bound, and Attach goes on as without hints. A failure that is
// not a lost race (the backing file's, not the number's) stops it at
// once with the number put back: every hint would fail the same way, and
// Attach finds the failure again and reports it.
func attachHinted(ctx context.Context, backing *os.File, name string, o Options, dio bool) *Device {
	for range maxHints {
		if ctx.Err() != nil {
			return nil
		}
		n, ok := takeHint()
		if !ok {
			return nil
		}
		d, err := attachAt(n, backing, name, o, dio)
		if err == nil {
			logDirectIO(ctx, d, o)
			return d
		}
		if !retryable(err) {
			hintFree(n)
			return nil
		}
	}
	return nil
}

// retryable tells a lost race for a free number (EBUSY from LOOP_CONFIGURE,
// or the device removed between GET_FREE and open) from a real failure.
func retryable(err error) bool {
	var oe *opError
	if !errors.As(err, &oe) {
		return false
	}
	switch oe.op {
	case "LOOP_CONFIGURE":
		return errors.Is(err, unix.EBUSY)
	case "open":
		return errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENODEV)
	}
	return false
}

// openBacking opens the image. O_DIRECT is asked for up front so that a
// filesystem without direct I/O support (ramfs, some FUSE) is found here,
// where falling back is cheap, instead of in the kernel's loop setup.
func openBacking(ctx context.Context, path string, o Options, open func(flags int) (*os.File, error)) (f *os.File, dio bool, err error) {
	flags := os.O_RDWR | unix.O_CLOEXEC
	if o.ReadOnly {
		flags = os.O_RDONLY | unix.O_CLOEXEC
	}
	if o.DirectIO {
		f, err = open(flags | unix.O_DIRECT)
		if err == nil {
			return f, true, checkBacking(f, path)
		}
		if !errors.Is(err, unix.EINVAL) {
			return nil, false, sysErr("open", path, err)
		}
		klog.FromContext(ctx).V(2).Info("backing filesystem refuses O_DIRECT, using buffered I/O", "backingFile", path)
	}
	f, err = open(flags)
	if err != nil {
		return nil, false, sysErr("open", path, err)
	}
	return f, false, checkBacking(f, path)
}

// checkBacking refuses what cannot back a loop device (a directory, a
// FIFO) with a clear error instead of an EINVAL from LOOP_CONFIGURE. It
// closes f on error.
func checkBacking(f *os.File, path string) error {
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return sysErr("fstat", path, err)
	}
	blockDev := fi.Mode()&os.ModeDevice != 0 && fi.Mode()&os.ModeCharDevice == 0
	if !fi.Mode().IsRegular() && !blockDev {
		f.Close()
		return fmt.Errorf("loopdev: %s is not a regular file or block device (%s): %w",
			path, fi.Mode().Type(), errdefs.ErrInvalidArgument)
	}
	return nil
}

// attachOnce does one GET_FREE + open + LOOP_CONFIGURE round.
func attachOnce(ctl, backing *os.File, name string, o Options, dio bool) (*Device, error) {
	n, err := getFree(ctl)
	if err != nil {
		return nil, err
	}
	return attachAt(n, backing, name, o, dio)
}

// attachAt opens loop device n and binds backing to it. Any error after
// LOOP_CONFIGURE clears the binding again before the fd is closed, so no
// half-configured device survives.
func attachAt(n int, backing *os.File, name string, o Options, dio bool) (d *Device, err error) {
	path := fmt.Sprintf("/dev/loop%d", n)
	mode := os.O_RDWR
	if o.ReadOnly {
		mode = os.O_RDONLY
	}
	// The mode matters: the kernel makes the device read-only when the fd
	// that configures it is not open for write.
	f, err := os.OpenFile(path, mode|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, sysErr("open", path, err)
	}
	configured := false
	defer func() {
		if err == nil {
			return
		}
		if configured {
			_ = withFd(f, func(fd int) error { return unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0) })
		}
		f.Close()
	}()

	if err = configure(f, backing, path, name, o, dio); err != nil {
		return nil, err
	}
	configured = true
	if !o.ReadOnly {
		if f, err = holdReadOnly(f, path); err != nil {
			return nil, err
		}
	}
	if d, err = newDevice(f, path); err != nil {
		return nil, err
	}
	if err = checkBound(d, backing); err != nil {
		return nil, err
	}
	return d, nil
}

// checkBound proves the kernel bound the file we opened: the status that
// LOOP_GET_STATUS64 reports must carry the backing fd's st_dev/st_ino,
// the same pair Adopt and Detach compare later.
func checkBound(d *Device, backing *os.File) error {
	var st unix.Stat_t
	if err := withFd(backing, func(fd int) error { return unix.Fstat(fd, &st) }); err != nil {
		return sysErr("fstat", d.Path, err)
	}
	if d.Identity.BackingDev != uint64(st.Dev) || d.Identity.BackingIno != st.Ino {
		return fmt.Errorf("loopdev: %s reports backing %d:%d, want %d:%d: %w", d.Path,
			d.Identity.BackingDev, d.Identity.BackingIno, st.Dev, st.Ino, errdefs.ErrAborted)
	}
	return nil
}

func getFree(ctl *os.File) (int, error) {
	var n int
	err := withFd(ctl, func(fd int) (err error) {
		n, err = unix.IoctlRetInt(fd, unix.LOOP_CTL_GET_FREE)
		return err
	})
	if err != nil {
		return 0, sysErr("LOOP_CTL_GET_FREE", loopControl, err)
	}
	return n, nil
}

func configure(f, backing *os.File, path, name string, o Options, dio bool) error {
	var cfg unix.LoopConfig
	if o.Autoclear {
		cfg.Info.Flags |= unix.LO_FLAGS_AUTOCLEAR
	}
	if o.ReadOnly {
		cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
	}
	if dio {
		cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
	}
	cfg.Size = o.BlockSize // struct loop_config.block_size
	// lo_file_name is informational (losetup shows it); the kernel keeps
	// the real path in the backing file itself.
	copy(cfg.Info.File_name[:unix.LO_NAME_SIZE-1], name)
	err := withFd(backing, func(bfd int) error {
		cfg.Fd = uint32(bfd)
		return withFd(f, func(fd int) error { return unix.IoctlLoopConfigure(fd, &cfg) })
	})
	if err != nil {
		return sysErr("LOOP_CONFIGURE", path+" with "+name, err)
	}
	return nil
}

// holdReadOnly swaps the configuring O_RDWR fd for an O_RDONLY one. The
// held fd must not count as a writer: with CONFIG_BLK_DEV_WRITE_MOUNTED=n a
// writer on the device makes mount(2) fail with EBUSY, and nothing should
// write through it anyway. The new fd is opened before the old one closes,
// so an Autoclear device never sees zero openers.
func holdReadOnly(rw *os.File, path string) (*os.File, error) {
	ro, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return rw, sysErr("open", path, err)
	}
	rw.Close()
	return ro, nil
}

func logDirectIO(ctx context.Context, d *Device, o Options) {
	if o.DirectIO && !d.DirectIO {
		klog.FromContext(ctx).V(2).Info("direct I/O asked for but not in effect", "device", d.Path)
	}
}
