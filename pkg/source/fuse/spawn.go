package fuse

import (
	"context"
	"fmt"
	"os"
	"syscall"

	"github.com/mountplan/mountplan/pkg/config"
)

// Command is a daemon's command line, rendered from its profile at stage
// time and kept in the journal, so that a restart (also after a plugin
// upgrade or a config change) runs exactly the daemon the volume was
// staged with. It holds paths of secret files, never secrets.
type Command struct {
	Path string   `json:"path"`
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
	// Stdin is a secret file that becomes the daemon's standard input
	// ("" for /dev/null).
	Stdin string `json:"stdin,omitempty"`
	// Log receives the daemon's standard output and error.
	Log   string           `json:"log"`
	RunAs *config.FuseUser `json:"runAs,omitempty"`
}

// Spawner starts daemons so that they outlive the plugin process. The
// supervisor only needs the returned identity: it watches, signals and
// adopts daemons through /proc and pidfds, which works for any process in
// the host's PID namespace. LocalSpawner runs them from the plugin; a
// spawner that asks the mounter sidecar to start them in its own container
// is what survives a restart of the plugin's container (see README).
type Spawner interface {
	Spawn(ctx context.Context, c Command) (Proc, error)
}

// LocalSpawner starts each daemon as a child of the plugin in a session of
// its own (setsid: its own process group, no controlling terminal, and no
// parent-death signal), with its working directory at / and exactly three
// descriptors: standard input (/dev/null or the secret file), and the log
// file as standard output and error. Every other descriptor of the plugin
// is close-on-exec (Go opens everything with O_CLOEXEC), so the daemon
// inherits nothing by accident: no socket, no /dev/fuse, no journal file.
// Writing to a file rather than a pipe matters: a daemon writing into a
// pipe whose reader (the plugin) died would get SIGPIPE.
type LocalSpawner struct{}

// maxLog is the size at which a daemon's log is rotated (one old copy).
const maxLog = 1 << 20

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
	if fi, err := os.Stat(c.Log); err == nil && fi.Size() > maxLog {
		_ = os.Rename(c.Log, c.Log+".1")
	}
	log, err := os.OpenFile(c.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return Proc{}, fmt.Errorf("daemon log: %w", err)
	}
	defer log.Close()
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
	id, idErr := identify(p.Pid)
	// Reap the child when it exits, while this process lives; after a
	// restart of the plugin the daemon's new parent reaps it.
	go func() { _, _ = p.Wait() }()
	if idErr != nil {
		return Proc{}, fmt.Errorf("start %s: %w", c.Path, idErr)
	}
	return id, nil
}
