// Package daemon starts processes that outlive their parent: each daemon
// runs in a session of its own with only the descriptors it is given,
// without the privileges of whoever started it (no_new_privs, a reduced
// capability bounding set), and is identified by its PID and its start
// time, so that whoever watches it later (the same process after a
// restart, or another one) can tell it from an unrelated process that
// reused its PID.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
)

// User is a numeric user and group a daemon runs as.
type User struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

// Command is a daemon's command line. It is meant to be recorded (a FUSE
// volume keeps it in the journal), so it must hold paths of secret files,
// never secrets.
type Command struct {
	Path string   `json:"path"`
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
	// Stdin is a file that becomes the daemon's standard input ("" for
	// /dev/null).
	Stdin string `json:"stdin,omitempty"`
	// Log receives the daemon's standard output and error.
	Log   string `json:"log"`
	RunAs *User  `json:"runAs,omitempty"`
	// Capabilities are all the daemon may ever have (canonical names, see
	// ParseCapabilities): its bounding set, and for a daemon that runs as
	// another user than root its ambient set. Empty: none.
	Capabilities []string `json:"capabilities,omitempty"`
	// Fuse, when set, is an open /dev/fuse whose mount the caller made
	// (fd mode): the daemon gets it as its fd 3 and serves it. Never
	// recorded: a descriptor means nothing outside this process.
	Fuse *os.File `json:"-"`
	// Sandbox, when set (fd mode), confines the daemon to namespaces of
	// its own and a root that holds only the system's directories and
	// what Sandbox names (sandbox_linux.go). It needs RunAs other than
	// root and no Capabilities.
	Sandbox *Sandbox `json:"sandbox,omitempty"`
	// Cgroup, when set, is the cgroup v2 directory the daemon starts in
	// (clone3 CLONE_INTO_CGROUP): it and every child of it are accounted
	// and limited there from their first instruction.
	Cgroup string `json:"cgroup,omitempty"`
	// CgroupV1, when set, are the cgroup v1 directories the daemon starts
	// in (the forking thread joins them first): with Cgroup, outside the
	// mounter's container's cgroups on a v1 or hybrid host.
	CgroupV1 []string `json:"cgroupV1,omitempty"`
	// Spec, when set, is what the command was rendered from: the mounter
	// renders every command itself, from Spec's profile and its own copy
	// of the admin's profiles, and records both.
	Spec *Spec `json:"spec,omitempty"`
}

// Spec is what a daemon's command line is rendered from: an admin profile,
// the parameters a volume chose for it and the places the mounter set up.
// Nothing in it is a secret.
type Spec struct {
	// Profile names the admin's profile.
	Profile string `json:"profile"`
	// Params are the volume's parameters (source and options), as the
	// profile accepted them.
	Params map[string]string `json:"params"`
	// ReadOnly: the volume is staged read-only.
	ReadOnly bool `json:"readOnly,omitempty"`
	// MountGroup is the group the volume is staged for (a pod's fsGroup),
	// nil for none.
	MountGroup *uint32 `json:"mountGroup,omitempty"`
	// Secrets names the secrets the volume was given, each a file in
	// Paths.SecretsDir.
	Secrets []string `json:"secrets,omitempty"`
	Paths   Paths    `json:"paths"`
}

// Paths are the host paths a daemon is given.
type Paths struct {
	MountPoint string `json:"mountPoint"`
	WorkDir    string `json:"workDir"`
	SecretsDir string `json:"secretsDir"`
	Log        string `json:"log"`
}

// Spawner starts daemons so that they outlive the caller. LocalSpawner
// runs them as children of the calling process; the mounter
// (internal/mounter) is the one caller, and tests give it other spawners.
type Spawner interface {
	Spawn(ctx context.Context, c Command) (Proc, error)
}

// LocalSpawner starts each daemon as a child of this process in a session
// of its own (setsid: its own process group, no controlling terminal, and
// no parent-death signal), with its working directory at / and exactly
// three descriptors: standard input (/dev/null or the given file), and the
// log file as standard output and error; and in fd mode a fourth, fd 3,
// the /dev/fuse of Command.Fuse. Every other descriptor of this
// process is close-on-exec (Go opens everything with O_CLOEXEC), so the
// daemon inherits nothing by accident: no socket, no /dev/fuse, no journal
// file. That includes descriptors this process inherited without
// close-on-exec from whoever started it: Spawn marks them close-on-exec
// first. Writing to a file rather than a pipe matters: a daemon writing into
// a pipe whose reader died would get SIGPIPE.
//
// The daemon runs with no_new_privs (a setuid binary such as fusermount3
// gains nothing) and a capability bounding set of Command.Capabilities
// only; its inheritable and ambient sets are empty but for those
// capabilities when it runs as a user other than root (RunAs), which
// then has them effective without a setuid helper. A daemon of RunAs has
// no supplementary groups.
//
// A daemon with a Sandbox (fd mode) is started through its shim instead
// (sandbox_linux.go): in mount, PID, IPC and UTS namespaces of its own,
// PID 1 of its PID namespace (the PID returned is its host PID), its root
// a tmpfs with the system's directories and what the Sandbox names, as
// RunAs with no capability in any set and no_new_privs. As PID 1 it
// ignores a SIGTERM it has no handler for, also from this namespace (only
// SIGKILL and SIGSTOP are forced): Terminate's SIGKILL after the grace
// ends it then (libfuse daemons handle SIGTERM).
//
// The standard input and the log are opened without following a symlink
// anywhere in their paths (the directories below the mounter's state dir
// are written by the plugin too): a path through a symlink fails the
// spawn with errdefs.ErrPermissionDenied, and nothing is renamed or
// created elsewhere.
type LocalSpawner struct{}

// MaxLog is the size at which a daemon's log is rotated (one old copy,
// LOG.1) when the next daemon starts with the same log.
const MaxLog = 1 << 20

// Spawn starts c and returns the daemon's identity.
func (LocalSpawner) Spawn(ctx context.Context, c Command) (Proc, error) {
	if err := ctx.Err(); err != nil {
		return Proc{}, err
	}
	caps, err := capNumbers(c.Capabilities)
	if err != nil {
		return Proc{}, err
	}
	stdinPath := c.Stdin
	if stdinPath == "" {
		stdinPath = os.DevNull
	}
	stdin, err := OpenNoSymlinks(stdinPath, unix.O_RDONLY, 0)
	if err != nil {
		return Proc{}, fmt.Errorf("daemon standard input: %w", err)
	}
	defer stdin.Close()
	log, err := OpenLog(c.Log)
	if err != nil {
		return Proc{}, fmt.Errorf("daemon log: %w", err)
	}
	defer log.Close()
	sys := &syscall.SysProcAttr{Setsid: true}
	if c.Cgroup != "" {
		cg, err := mountns.Openat2(unix.AT_FDCWD, c.Cgroup, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0, mountns.ResolveNoSymlinks)
		if err != nil {
			return Proc{}, fmt.Errorf("daemon cgroup: %w", openError(c.Cgroup, err))
		}
		defer unix.Close(cg)
		sys.UseCgroupFD, sys.CgroupFD = true, cg
	}
	files := []*os.File{stdin, log, log}
	if c.Fuse != nil {
		files = append(files, c.Fuse) // fd 3: fuseprofile.FdMountPoint
	}
	closeOnExecAll()
	var p *os.Process
	if c.Sandbox != nil {
		p, err = startSandboxed(c, files, sys)
	} else {
		p, err = startDirect(c, caps, files, sys)
	}
	if err != nil {
		return Proc{}, fmt.Errorf("start %s: %w", c.Path, err)
	}
	id, idErr := Identify(p.Pid)
	// Reap the child when it exits, while this process lives; after this
	// process is gone the daemon's new parent (init or a subreaper) does.
	go func() { _, _ = p.Wait() }()
	if idErr != nil {
		return Proc{}, fmt.Errorf("start %s: %w", c.Path, idErr)
	}
	return id, nil
}

// startDirect starts c's binary itself, as RunAs, with its thread's
// credentials first reduced to caps (startRestricted).
func startDirect(c Command, caps []uintptr, files []*os.File, sys *syscall.SysProcAttr) (*os.Process, error) {
	if c.RunAs != nil {
		sys.Credential = &syscall.Credential{Uid: c.RunAs.UID, Gid: c.RunAs.GID, Groups: []uint32{}}
		if c.RunAs.UID != 0 {
			sys.AmbientCaps = caps
		}
	}
	return startRestricted(caps, c.CgroupV1, func() (*os.Process, error) {
		return os.StartProcess(c.Path, append([]string{c.Path}, c.Args...), &os.ProcAttr{
			Dir:   "/",
			Env:   c.Env,
			Files: files,
			Sys:   sys,
		})
	})
}

// startSandboxed starts c's sandbox shim (sandbox_linux.go), which execs
// c's binary. Its thread is not restricted first: the shim needs root's
// capabilities to build the root (a root process's capabilities after
// execve are its bounding set), and it drops them all itself.
func startSandboxed(c Command, files []*os.File, sys *syscall.SysProcAttr) (*os.Process, error) {
	path, argv, env, files, pipe, err := sandboxed(c, files, sys)
	if err != nil {
		return nil, err
	}
	defer pipe.Close()
	return startOnThread(false, nil, c.CgroupV1, func() (*os.Process, error) {
		return os.StartProcess(path, argv, &os.ProcAttr{Dir: "/", Env: env, Files: files, Sys: sys})
	})
}

// OpenNoSymlinks opens the absolute path p with flags, following no
// symlink on the way (openat2 RESOLVE_NO_SYMLINKS from /); a path through
// one wraps errdefs.ErrPermissionDenied. Only a regular file or a
// character device (/dev/null) is accepted when opening for reading or
// writing.
func OpenNoSymlinks(p string, flags int, mode uint32) (*os.File, error) {
	if !filepath.IsAbs(p) {
		return nil, fmt.Errorf("%q is not an absolute path: %w", p, errdefs.ErrInvalidArgument)
	}
	if flags&unix.O_PATH == 0 {
		flags |= unix.O_NONBLOCK // a FIFO must not block the open; checkRegular clears it
	}
	fd, err := mountns.Openat2(unix.AT_FDCWD, p, flags, mode, mountns.ResolveNoSymlinks)
	if err != nil {
		return nil, openError(p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	if flags&unix.O_PATH == 0 {
		if err := checkRegular(f, p); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

func openError(p string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%s leads through a symlink, which is never followed: %w", p, errdefs.ErrPermissionDenied)
	case errors.Is(err, unix.ENXIO):
		return fmt.Errorf("%s is not a regular file (a FIFO or socket): %w", p, errdefs.ErrPermissionDenied)
	}
	return &os.PathError{Op: "open", Path: p, Err: err}
}

// checkRegular accepts a regular file or a character device, and clears
// the O_NONBLOCK it was opened with (a FIFO would have blocked the open).
func checkRegular(f *os.File, p string) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &os.PathError{Op: "fstat", Path: p, Err: err}
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFCHR {
		return fmt.Errorf("%s is not a regular file: %w", p, errdefs.ErrPermissionDenied)
	}
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err == nil {
		_, err = unix.FcntlInt(f.Fd(), unix.F_SETFL, fl&^unix.O_NONBLOCK)
	}
	return err
}

// OpenLog opens a daemon's log for appending (mode 0600), rotating it
// first when it has grown past MaxLog: LOG becomes LOG.1. Its directory is
// opened without following a symlink (OpenNoSymlinks), and the rotation
// and the open happen in that directory (renameat, openat with
// O_NOFOLLOW), so no symlink planted in the path leads either elsewhere.
func OpenLog(p string) (*os.File, error) {
	dir, err := OpenNoSymlinks(filepath.Dir(p), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	return OpenLogAt(dir, filepath.Base(p), p)
}

// OpenLogAt is OpenLog of the file name in the open directory dir; p is
// its path, for errors.
func OpenLogAt(dir *os.File, name, p string) (*os.File, error) {
	dfd := int(dir.Fd())
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Size > MaxLog {
		if err := unix.Renameat(dfd, name, dfd, name+".1"); err != nil {
			return nil, &os.PathError{Op: "rotate", Path: p, Err: err}
		}
	}
	fd, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_APPEND|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, openError(p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	if err := checkRegular(f, p); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// closeOnExecAll marks every descriptor from 3 up close-on-exec, so that a
// descriptor this process inherited without the flag (from a shell or a
// test harness that started it) does not reach the daemon. Go opens its own
// descriptors with O_CLOEXEC already; a child that is meant to get one has
// it dup2'ed into place, which clears the flag on the copy.
func closeOnExecAll() {
	if err := unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC); err == nil {
		return
	}
	// Kernels before 5.11: one fcntl per open descriptor.
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= 3 {
			_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC)
		}
	}
}
