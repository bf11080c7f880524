package mountns

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Namespace is an open handle on a mount namespace. Holding it keeps the
// namespace alive, so a PID that exits or is reused after OpenPID cannot
// redirect the mounts elsewhere.
type Namespace struct {
	ns   *os.File // /proc/PID/ns/mnt
	proc *os.File // the caller's /proc, still reachable after setns
	id   plan.Namespace
	self bool // the caller's own namespace: Do needs no setns
	// idRead: Self's namespace ID was looked up (it may be 0 on old kernels).
	idRead bool
}

// Self opens the caller's own mount namespace.
//
// It holds no file: the caller's namespace needs no handle to be entered
// (Do runs fn in place) and cannot go away under it. It reads only the
// inode, with one stat, since kubelet's publishes open it twice per cycle;
// Identity reads the namespace ID on first use.
// (thread-self, not self: /proc/self names the main thread, and only the
// calling thread is sure to be in the process's own namespace.)
func Self() (*Namespace, error) {
	var st unix.Stat_t
	if err := unix.Stat(nsPath("thread-self"), &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: nsPath("thread-self"), Err: err}
	}
	return &Namespace{id: plan.Namespace{Inode: st.Ino}, self: true}, nil
}

// SelfIdentity returns the full identity of the caller's own namespace.
func SelfIdentity() (plan.Namespace, error) {
	f, err := openNS("thread-self")
	if err != nil {
		return plan.Namespace{}, err
	}
	defer f.Close()
	return identityOf(f)
}

// OpenPID opens the mount namespace of process pid (as the caller's /proc
// sees it). It fails with errdefs.ErrNotFound when the process does not
// exist and with errdefs.ErrFailedPrecondition when want is not zero and
// the process lives in another namespace (a reused PID, or a namespace that
// got the inode of a dead one): see plan.Namespace.Matches.
func OpenPID(pid int, want plan.Namespace) (*Namespace, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("pid %d: %w", pid, errdefs.ErrInvalidArgument)
	}
	return open(strconv.Itoa(pid), want)
}

func open(pid string, want plan.Namespace) (_ *Namespace, err error) {
	n := &Namespace{}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if n.ns, err = openNS(pid); err != nil {
		return nil, err
	}
	if n.id, err = identityOf(n.ns); err != nil {
		return nil, err
	}
	if !want.Matches(n.id) {
		return nil, fmt.Errorf("pid %s is in mount namespace %s, not %s (the process was replaced): %w",
			pid, n.id, want, errdefs.ErrFailedPrecondition)
	}
	var own unix.Stat_t
	// thread-self, not self: /proc/self names the main thread, and only
	// the calling thread is sure to be in the process's own namespace.
	// Inodes of live namespaces are unique, and n holds its namespace.
	if err := unix.Stat("/proc/thread-self/ns/mnt", &own); err != nil {
		return nil, &os.PathError{Op: "stat", Path: "/proc/thread-self/ns/mnt", Err: err}
	}
	n.self = own.Ino == n.id.Inode
	if n.proc, err = openFile("/proc", unix.O_PATH|unix.O_DIRECTORY); err != nil {
		return nil, err
	}
	return n, nil
}

func openFile(path string, flags int) (*os.File, error) {
	fd, err := unix.Open(path, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// Identity identifies the namespace.
//
// For Self it is read on first use: the publish path never asks for it.
func (n *Namespace) Identity() plan.Namespace {
	if n.self && n.id.ID == 0 && !n.idRead {
		if id, err := SelfIdentity(); err == nil {
			n.id = id
		}
		n.idRead = true
	}
	return n.id
}

// Inode is the inode of the namespace (of /proc/PID/ns/mnt): Identity().Inode.
func (n *Namespace) Inode() uint64 { return n.id.Inode }

// IsSelf reports whether this is the caller's own mount namespace.
func (n *Namespace) IsSelf() bool { return n.self }

// Close releases the handle; the namespace lives on while processes use it.
func (n *Namespace) Close() error {
	return errors.Join(closeFile(n.ns), closeFile(n.proc))
}

func closeFile(f *os.File) error {
	if f == nil {
		return nil
	}
	return f.Close()
}

// Do runs fn with the calling thread inside the namespace: paths fn uses
// resolve as the namespace's processes see them, from its root. fn runs on
// a goroutine of its own, locked to an OS thread that is never unlocked, so
// the Go runtime ends that thread with the goroutine instead of handing a
// thread in a foreign namespace to other goroutines. Fds opened before Do
// stay usable inside it.
func (n *Namespace) Do(fn func() error) error {
	if n.self {
		return fn()
	}
	errc := make(chan error, 1)
	go n.enterAndRun(fn, errc)
	return <-errc
}

func (n *Namespace) enterAndRun(fn func() error, errc chan<- error) {
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// This is the process's main thread, which the runtime never ends:
		// left in another namespace it would stay there and change what
		// /proc/self shows for the whole process. While this goroutine
		// holds it, no other goroutine can run on it, so start over on a
		// new one and give the untouched thread back.
		defer runtime.UnlockOSThread()
		inner := make(chan error, 1)
		go n.enterAndRun(fn, inner)
		errc <- <-inner
		return
	}
	// setns(CLONE_NEWNS) refuses a thread that shares its filesystem
	// information (root, cwd) with the other threads of the process.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		errc <- fmt.Errorf("unshare(CLONE_FS): %w", err)
		return
	}
	if err := unix.Setns(int(n.ns.Fd()), unix.CLONE_NEWNS); err != nil {
		errc <- fmt.Errorf("setns into mount namespace %s: %w", n.id, err)
		return
	}
	errc <- fn()
}

// MountInfo returns the mount table of the calling thread's namespace, which
// inside Do is this namespace's, with paths as seen from its root. It reads
// the caller's /proc through a handle opened before entering, because the
// namespace's own /proc (if any) belongs to another PID namespace where this
// thread does not exist.
func (n *Namespace) MountInfo(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	dirfd := unix.AT_FDCWD
	path := "/proc/thread-self/mountinfo"
	if n.proc != nil {
		dirfd, path = int(n.proc.Fd()), "thread-self/mountinfo"
	}
	fd, err := unix.Openat(dirfd, path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: "/proc/thread-self/mountinfo", Err: err}
	}
	f := os.NewFile(uintptr(fd), "/proc/thread-self/mountinfo")
	defer f.Close()
	return mountinfo.GetMountsFromReader(f, filter)
}

// Attach attaches the detached mount fd (from Build) at target in the
// calling thread's namespace: call it inside Do. A final symlink in target
// is not followed. Close fd soon afterwards: it is an open file on the
// mount's root and keeps the mount busy.
func Attach(fd *os.File, target string) error {
	err := unix.MoveMount(int(fd.Fd()), "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH)
	runtime.KeepAlive(fd)
	if errors.Is(err, unix.ENOSYS) {
		return errNoNewAPI("move_mount")
	}
	if err != nil {
		return &OpError{Op: "move_mount", Path: target, Err: err}
	}
	return nil
}
