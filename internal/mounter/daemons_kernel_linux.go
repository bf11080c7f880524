package mounter

// What the daemons' code reads of the mount table and of fusectl: nothing
// here stats a path that may be a dead or hung FUSE mount.

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// mountWatch wakes when the mounter's mount table changes:
// /proc/self/mountinfo polls with POLLPRI after every mount or unmount in
// the namespace.
type mountWatch struct{ f *os.File }

func newMountWatch() (*mountWatch, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return &mountWatch{f: f}, nil
}

// wait returns after a change of the table or d, whichever comes first.
func (w *mountWatch) wait(d time.Duration) {
	fds := []unix.PollFd{{Fd: int32(w.f.Fd()), Events: unix.POLLPRI}}
	_, _ = unix.Poll(fds, max(int(d/time.Millisecond), 1))
}

func (w *mountWatch) close() { w.f.Close() }

// fusectl reaches the FUSE control filesystem through a private, detached
// instance (fsopen/fsmount): it appears in no mount table, needs no
// namespace, and goes away with its fd. Where the new mount API is
// missing, the host's /sys/fs/fuse/connections is used if mounted.
type fusectl struct {
	once sync.Once
	root int // O_PATH fd of the control filesystem's root, or -1
	err  error
}

const fusectlDir = "/sys/fs/fuse/connections"

func (c *fusectl) open() (int, error) {
	c.once.Do(func() {
		c.root, c.err = openFusectl()
	})
	return c.root, c.err
}

func openFusectl() (int, error) {
	fsfd, err := unix.Fsopen("fusectl", unix.FSOPEN_CLOEXEC)
	if err == nil {
		defer unix.Close(fsfd)
		if err = unix.FsconfigCreate(fsfd); err == nil {
			var mfd int
			mfd, err = unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
			if err == nil {
				return mfd, nil
			}
		}
	}
	if mounted, _ := mountinfo.Mounted(fusectlDir); mounted {
		return unix.Open(fusectlDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	return -1, fmt.Errorf("fusectl: cannot mount a private instance (%w) and %s is not mounted", err, fusectlDir)
}

func (c *fusectl) file(conn uint64, name string, flags int) (*os.File, error) {
	root, err := c.open()
	if err != nil {
		return nil, err
	}
	rel := strconv.FormatUint(conn, 10) + "/" + name
	fd, err := unix.Openat(root, rel, flags|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: fusectlDir + "/" + rel, Err: err}
	}
	return os.NewFile(uintptr(fd), fusectlDir+"/"+rel), nil
}

// abort aborts FUSE connection conn: every request fails with ENOTCONN,
// blocked callers return, and the daemon's /dev/fuse reads fail so it
// exits. A connection that is already gone is not an error.
func (c *fusectl) abort(conn uint64) error {
	f, err := c.file(conn, "abort", unix.O_WRONLY)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write([]byte("1")); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("abort FUSE connection %d: %w", conn, err)
	}
	return nil
}

// waiting returns how many requests of conn wait for the daemon.
func (c *fusectl) waiting(conn uint64) (int, error) {
	f, err := c.file(conn, "waiting", unix.O_RDONLY)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	b := make([]byte, 32)
	k, err := f.Read(b)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b[:k])))
}
