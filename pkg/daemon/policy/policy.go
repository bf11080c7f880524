// Package policy is how the mounter starts daemons for the plugin (the
// Mounter service's SpawnDaemon): it renders each command itself, from its
// own copy of the admin's FUSE profiles and a daemon.Spec (profile name,
// the volume's parameters, paths), so that whatever a caller sends, no
// binary, argument, environment variable or user reaches a daemon that the
// admin's profile would not give it.
package policy

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fuseprofile"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Policy says which daemons the mounter starts. Starting daemons in the
// mounter puts them in the mounter's container (its cgroup), which a
// restart of the plugin's container leaves alone.
type Policy struct {
	// Profiles are the admin's FUSE profiles. Empty: nothing is started.
	Profiles []fuseprofile.Profile
	// Roots are the directories below which a daemon's paths (mount point,
	// work dir, secrets dir, log) must lie, symlinks resolved.
	Roots []string
	// Spawner starts the daemons; nil means daemon.LocalSpawner.
	Spawner daemon.Spawner
}

// For is the policy of cfg's FUSE profiles with paths below roots. A nil
// cfg allows nothing.
func For(cfg *config.Config, roots []string) *Policy {
	p := &Policy{Roots: roots}
	if cfg != nil {
		p.Profiles = cfg.FuseProfiles
	}
	return p
}

// Names lists the profiles, for a log line.
func (p *Policy) Names() []string {
	var out []string
	for _, prof := range p.Profiles {
		out = append(out, prof.Name)
	}
	return out
}

// Spawn renders the command of spec (Command) and starts it.
func (p *Policy) Spawn(ctx context.Context, spec daemon.Spec) (daemon.Command, daemon.Proc, error) {
	c, err := p.Command(spec)
	if err != nil {
		return c, daemon.Proc{}, err
	}
	sp := p.Spawner
	if sp == nil {
		sp = daemon.LocalSpawner{}
	}
	proc, err := sp.Spawn(ctx, c)
	return c, proc, err
}

// Command renders the command of spec from the policy's own profile of
// that name. It fails with FailedPrecondition when the policy has no
// profiles, InvalidArgument for a spec the profile refuses, NotFound for a
// path source that does not exist, and PermissionDenied for paths outside
// the roots. Errors never quote a secret: a spec holds none.
func (p *Policy) Command(spec daemon.Spec) (daemon.Command, error) {
	if p == nil || len(p.Profiles) == 0 {
		return daemon.Command{}, fmt.Errorf("this mounter starts no daemons: it has no FUSE profiles (--config): %w", errdefs.ErrFailedPrecondition)
	}
	prof := fuseprofile.Find(p.Profiles, spec.Profile)
	if prof == nil {
		return daemon.Command{}, fmt.Errorf("fuse profile %q is not in this mounter's config: %w", spec.Profile, errdefs.ErrInvalidArgument)
	}
	// The parameters are checked before the source is looked up on the host.
	params, _, err := fuseprofile.VolumeParams([]fuseprofile.Profile{*prof}, spec.Params)
	if err != nil {
		return daemon.Command{}, err
	}
	src, err := prof.ResolveSource(params[fuseprofile.CtxSource])
	if err != nil {
		return daemon.Command{}, err
	}
	c, err := prof.Command(spec, src)
	if err != nil {
		return daemon.Command{}, err
	}
	if err := p.checkPaths(spec.Paths); err != nil {
		return daemon.Command{}, err
	}
	return c, nil
}

// checkPaths keeps a daemon's paths below the roots once symlinks are
// resolved. The mount point and work dir must be directories themselves,
// not symlinks: a daemon mounting over a symlink to /etc would hide the
// host's /etc. The secrets dir holds the files the daemon reads; the log
// is opened with O_NOFOLLOW, so its directory is what is checked.
func (p *Policy) checkPaths(ps daemon.Paths) error {
	for _, f := range []struct {
		what, path string
		dir        bool
	}{
		{"mount point", ps.MountPoint, true}, {"work dir", ps.WorkDir, true},
		{"secrets dir", ps.SecretsDir, false}, {"log", ps.Log, false},
	} {
		if err := p.checkPath(f.what, f.path, f.dir); err != nil {
			return err
		}
	}
	return nil
}

func (p *Policy) checkPath(what, path string, dir bool) error {
	if !plan.WithinAny(p.Roots, path) {
		return fmt.Errorf("daemon %s %s is outside the mounter's allowed roots: %w", what, path, errdefs.ErrPermissionDenied)
	}
	parent, err := filepath.EvalSymlinks(filepath.Dir(path))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("daemon %s %s: %w: %w", what, path, err, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("daemon %s %s: %w", what, path, err)
	}
	if !plan.WithinAny(plan.RealPaths(p.Roots), filepath.Join(parent, filepath.Base(path))) {
		return fmt.Errorf("daemon %s %s leads outside the allowed roots through a symlink: %w", what, path, errdefs.ErrPermissionDenied)
	}
	if !dir {
		return nil
	}
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("daemon %s: %w: %w", what, err, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("daemon %s: %w", what, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("daemon %s %s is not a directory (a symlink is not followed): %w", what, path, errdefs.ErrPermissionDenied)
	}
	return nil
}
