// Package policy says which daemons the mounter starts for the plugin
// (the Mounter service's SpawnDaemon): only what the admin's FUSE profiles
// allow, whatever the caller asks.
package policy

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Policy says which daemons the Mounter service's SpawnDaemon starts.
// Starting daemons in the mounter puts them in the mounter's container (its
// cgroup), which a restart of the plugin's container leaves alone.
type Policy struct {
	// Allowed are the binaries that may be started, each with the user it
	// runs as (nil: the mounter's own). Empty: SpawnDaemon is refused.
	Allowed []Daemon
	// Roots are the directories below which a daemon's standard input and
	// log must lie (symlinks of their directories resolved).
	Roots []string
	// Spawner starts the daemons; nil means daemon.LocalSpawner.
	Spawner daemon.Spawner
}

// Daemon is one binary a Policy allows.
type Daemon struct {
	Path  string
	RunAs *daemon.User
}

// For allows the binary (and user) of every FUSE profile of
// cfg, with standard input and log below roots. A nil cfg allows nothing.
func For(cfg *config.Config, roots []string) *Policy {
	p := &Policy{Roots: roots}
	if cfg == nil {
		return p
	}
	for _, prof := range cfg.FuseProfiles {
		p.Allowed = append(p.Allowed, Daemon{Path: prof.Binary, RunAs: prof.RunAs})
	}
	return p
}

// Binaries lists the allowed binaries, for a log line.
func (p *Policy) Binaries() []string {
	var out []string
	for _, a := range p.Allowed {
		if !slices.Contains(out, a.Path) {
			out = append(out, a.Path)
		}
	}
	return out
}

// Check refuses a command the policy does not allow: FailedPrecondition
// when it allows nothing, InvalidArgument otherwise. Its errors quote the
// binary and the paths, never arguments or environment values.
func (p *Policy) Check(c daemon.Command) error {
	if p == nil || len(p.Allowed) == 0 {
		return fmt.Errorf("this mounter starts no daemons: it has no FUSE profiles (--config): %w", errdefs.ErrFailedPrecondition)
	}
	if !plan.IsCleanAbs(c.Path) {
		return fmt.Errorf("daemon binary %q must be a clean absolute path: %w", c.Path, errdefs.ErrInvalidArgument)
	}
	binary, user := false, false
	for _, a := range p.Allowed {
		if a.Path == c.Path {
			binary = true
			user = user || sameUser(a.RunAs, c.RunAs)
		}
	}
	if !binary {
		return fmt.Errorf("daemon binary %s is not the binary of a FUSE profile of this mounter's config: %w", c.Path, errdefs.ErrInvalidArgument)
	}
	if !user {
		return fmt.Errorf("no FUSE profile of this mounter's config runs %s as %s: %w", c.Path, userString(c.RunAs), errdefs.ErrInvalidArgument)
	}
	for i, a := range c.Args {
		if strings.ContainsRune(a, 0) {
			return fmt.Errorf("daemon argument %d holds a NUL byte: %w", i+1, errdefs.ErrInvalidArgument)
		}
	}
	for i, e := range c.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsRune(e, 0) {
			return fmt.Errorf("daemon environment entry %d is not KEY=VALUE: %w", i+1, errdefs.ErrInvalidArgument)
		}
	}
	if c.Stdin != "" {
		if err := p.checkFile("standard input", c.Stdin); err != nil {
			return err
		}
	}
	if c.Log == "" {
		return fmt.Errorf("daemon log path is required: %w", errdefs.ErrInvalidArgument)
	}
	return p.checkFile("log", c.Log)
}

// checkFile accepts a clean absolute path below a root, also once the
// symlinks of its directory are resolved (the file itself is opened with
// O_NOFOLLOW).
func (p *Policy) checkFile(what, path string) error {
	if !plan.IsCleanAbs(path) {
		return fmt.Errorf("daemon %s %q must be a clean absolute path: %w", what, path, errdefs.ErrInvalidArgument)
	}
	if !plan.WithinAny(p.Roots, path) {
		return fmt.Errorf("daemon %s %s is outside the allowed roots: %w", what, path, errdefs.ErrInvalidArgument)
	}
	dir, err := filepath.EvalSymlinks(filepath.Dir(path))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("daemon %s %s: %w: %w", what, path, err, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		return err
	}
	var real []string
	for _, r := range p.Roots {
		if rr, err := filepath.EvalSymlinks(r); err == nil {
			real = append(real, rr)
		}
	}
	if !plan.WithinAny(real, filepath.Join(dir, filepath.Base(path))) {
		return fmt.Errorf("daemon %s %s leads outside the allowed roots through a symlink: %w", what, path, errdefs.ErrInvalidArgument)
	}
	return nil
}

func sameUser(a, b *daemon.User) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return *a == *b
}

func userString(u *daemon.User) string {
	if u == nil {
		return "the mounter's user"
	}
	return fmt.Sprintf("uid %d gid %d", u.UID, u.GID)
}
