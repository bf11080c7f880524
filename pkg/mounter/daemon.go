package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"path/filepath"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// DaemonPolicy says which daemons the Mounter service's SpawnDaemon starts.
// Starting daemons in the mounter puts them in the mounter's container (its
// cgroup), which a restart of the plugin's container leaves alone.
type DaemonPolicy struct {
	// Allowed are the binaries that may be started, each with the user it
	// runs as (nil: the mounter's own). Empty: SpawnDaemon is refused.
	Allowed []AllowedDaemon
	// Roots are the directories below which a daemon's standard input and
	// log must lie (symlinks of their directories resolved).
	Roots []string
	// Spawner starts the daemons; nil means daemon.LocalSpawner.
	Spawner daemon.Spawner
}

// AllowedDaemon is one binary a DaemonPolicy allows.
type AllowedDaemon struct {
	Path  string
	RunAs *daemon.User
}

// DaemonPolicyFor allows the binary (and user) of every FUSE profile of
// cfg, with standard input and log below roots. A nil cfg allows nothing.
func DaemonPolicyFor(cfg *config.Config, roots []string) *DaemonPolicy {
	p := &DaemonPolicy{Roots: roots}
	if cfg == nil {
		return p
	}
	for _, prof := range cfg.FuseProfiles {
		a := AllowedDaemon{Path: prof.Binary}
		if prof.RunAs != nil {
			a.RunAs = &daemon.User{UID: prof.RunAs.UID, GID: prof.RunAs.GID}
		}
		p.Allowed = append(p.Allowed, a)
	}
	return p
}

// Binaries lists the allowed binaries, for a log line.
func (p *DaemonPolicy) Binaries() []string {
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
func (p *DaemonPolicy) Check(c daemon.Command) error {
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
func (p *DaemonPolicy) checkFile(what, path string) error {
	if !plan.IsCleanAbs(path) {
		return fmt.Errorf("daemon %s %q must be a clean absolute path: %w", what, path, errdefs.ErrInvalidArgument)
	}
	if !within(p.Roots, path) {
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
	if !within(real, filepath.Join(dir, filepath.Base(path))) {
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

func (s *server) SpawnDaemon(ctx context.Context, req *api.SpawnDaemonRequest) (*api.SpawnDaemonResponse, error) {
	c := CommandFromProto(req)
	if err := s.daemons.Check(c); err != nil {
		return nil, err
	}
	sp := s.daemons.Spawner
	if sp == nil {
		sp = daemon.LocalSpawner{}
	}
	logger := klog.FromContext(ctx)
	logger.V(5).Info("Starting daemon", "path", c.Path, "args", c.Args, "env", c.Env, "stdin", c.Stdin, "log", c.Log)
	p, err := sp.Spawn(ctx, c)
	if err != nil {
		return nil, err
	}
	logger.V(2).Info("Started daemon", "path", c.Path, "pid", p.PID, "startTime", p.StartTime, "log", c.Log)
	return &api.SpawnDaemonResponse{Pid: int64(p.PID), StartTime: p.StartTime}, nil
}

// CommandToProto converts a daemon's command to its wire form.
func CommandToProto(c daemon.Command) *api.SpawnDaemonRequest {
	r := &api.SpawnDaemonRequest{Path: c.Path, Args: c.Args, Env: c.Env, StdinPath: c.Stdin, LogPath: c.Log}
	if c.RunAs != nil {
		r.RunAs = &api.DaemonUser{Uid: c.RunAs.UID, Gid: c.RunAs.GID}
	}
	return r
}

// CommandFromProto converts a daemon's command from its wire form.
func CommandFromProto(r *api.SpawnDaemonRequest) daemon.Command {
	c := daemon.Command{Path: r.GetPath(), Args: r.GetArgs(), Env: r.GetEnv(), Stdin: r.GetStdinPath(), Log: r.GetLogPath()}
	if u := r.GetRunAs(); u != nil {
		c.RunAs = &daemon.User{UID: u.GetUid(), GID: u.GetGid()}
	}
	return c
}

// NewSpawner returns a daemon.Spawner that has the Mounter service (the
// sidecar's `serve`) start daemons, in the sidecar's container. Errors wrap
// the errdefs sentinel of their status code.
func NewSpawner(cc grpc.ClientConnInterface) daemon.Spawner {
	return &spawner{c: api.NewMounterClient(cc)}
}

type spawner struct{ c api.MounterClient }

func (s *spawner) Spawn(ctx context.Context, c daemon.Command) (daemon.Proc, error) {
	resp, err := s.c.SpawnDaemon(ctx, CommandToProto(c))
	if err != nil {
		return daemon.Proc{}, fmt.Errorf("mounter: %w", errdefs.FromGRPC(err))
	}
	if resp.GetPid() <= 0 || resp.GetPid() > math.MaxInt32 {
		return daemon.Proc{}, fmt.Errorf("the mounter answered pid %d for %s: %w", resp.GetPid(), c.Path, errdefs.ErrUnavailable)
	}
	return daemon.Proc{PID: int(resp.GetPid()), StartTime: resp.GetStartTime()}, nil
}
