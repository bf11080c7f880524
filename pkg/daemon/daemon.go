// Package daemon starts processes that outlive their parent: each daemon
// runs in a session of its own with only the descriptors it is given, and
// is identified by its PID and its start time, so that whoever watches it
// later (the same process after a restart, or another one) can tell it
// from an unrelated process that reused its PID.
package daemon

import (
	"context"
	"fmt"
	"math"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
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
	// Spec, when set, is what the command was rendered from. A spawner
	// that trusts no caller (the mounter's) renders the command again
	// from Spec and its own copy of the admin's profiles, and ignores
	// the fields above.
	Spec *Spec `json:"spec,omitempty"`
}

// Spec is what a daemon's command line is rendered from: an admin profile,
// the parameters a volume chose for it and the places the plugin set up.
// Nothing in it is a secret.
type Spec struct {
	// Profile names the admin's profile.
	Profile string `json:"profile"`
	// Params are the volume's parameters (source and options), as the
	// profile accepted them.
	Params map[string]string `json:"params"`
	// ReadOnly: the volume is staged read-only.
	ReadOnly bool `json:"readOnly,omitempty"`
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

// Spawner starts daemons so that they outlive the caller. Callers only
// need the returned identity: they watch, signal and adopt daemons through
// /proc and pidfds, which works for any process in the host's PID
// namespace, whoever started it. LocalSpawner runs them as children of the
// calling process; the Mounter service's client (pkg/mounter/service.NewSpawner) asks
// the sidecar to run them in its own container.
type Spawner interface {
	Spawn(ctx context.Context, c Command) (Proc, error)
}

// LocalSpawner starts each daemon as a child of this process in a session
// of its own (setsid: its own process group, no controlling terminal, and
// no parent-death signal), with its working directory at / and exactly
// three descriptors: standard input (/dev/null or the given file), and the
// log file as standard output and error. Every other descriptor of this
// process is close-on-exec (Go opens everything with O_CLOEXEC), so the
// daemon inherits nothing by accident: no socket, no /dev/fuse, no journal
// file. That includes descriptors this process inherited without
// close-on-exec from whoever started it: Spawn marks them close-on-exec
// first. Writing to a file rather than a pipe matters: a daemon writing into
// a pipe whose reader died would get SIGPIPE.
type LocalSpawner struct{}

// MaxLog is the size at which a daemon's log is rotated (one old copy,
// LOG.1) when the next daemon starts with the same log.
const MaxLog = 1 << 20

// Spawn starts c and returns the daemon's identity.
func (LocalSpawner) Spawn(ctx context.Context, c Command) (Proc, error) {
	if err := ctx.Err(); err != nil {
		return Proc{}, err
	}
	stdinPath := c.Stdin
	if stdinPath == "" {
		stdinPath = os.DevNull
	}
	stdin, err := os.OpenFile(stdinPath, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return Proc{}, fmt.Errorf("daemon standard input: %w", err)
	}
	defer stdin.Close()
	if fi, err := os.Stat(c.Log); err == nil && fi.Size() > MaxLog {
		_ = os.Rename(c.Log, c.Log+".1")
	}
	log, err := os.OpenFile(c.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return Proc{}, fmt.Errorf("daemon log: %w", err)
	}
	defer log.Close()
	closeOnExecAll()
	sys := &syscall.SysProcAttr{Setsid: true}
	if c.RunAs != nil {
		sys.Credential = &syscall.Credential{Uid: c.RunAs.UID, Gid: c.RunAs.GID, NoSetGroups: true}
	}
	p, err := os.StartProcess(c.Path, append([]string{c.Path}, c.Args...), &os.ProcAttr{
		Dir:   "/",
		Env:   c.Env,
		Files: []*os.File{stdin, log, log},
		Sys:   sys,
	})
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
