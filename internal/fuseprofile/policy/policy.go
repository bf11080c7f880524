// Package policy is how the mounter renders the daemons it starts for the
// plugin (mounter.Daemons): it renders each command itself, from its own
// copy of the admin's FUSE profiles and a daemon.Spec (profile name, the
// volume's parameters, the paths the mounter made), so that whatever a
// caller sends, no binary, argument, environment variable, user or
// capability reaches a daemon that the admin's profile would not give it.
package policy

import (
	"fmt"
	"os"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Policy says which daemons the mounter starts. Starting daemons in the
// mounter puts them in the mounter's container (its cgroup), which a
// restart of the plugin's container leaves alone.
type Policy struct {
	// Profiles are the admin's FUSE profiles. Empty: nothing is started.
	Profiles []fuseprofile.Profile
	// Roots are the directories below which a daemon's paths (mount point,
	// work dir, secrets dir, log) must lie. The mounter makes those paths
	// itself below its state dir, without following a symlink; this is
	// the check that a path it is handed is one of them.
	Roots []string
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

// Profile returns the policy's own profile called name. It fails with
// FailedPrecondition when the policy has no profiles and InvalidArgument
// for a name it lacks.
func (p *Policy) Profile(name string) (*fuseprofile.Profile, error) {
	if p == nil || len(p.Profiles) == 0 {
		return nil, fmt.Errorf("this mounter starts no daemons: it has no FUSE profiles (--config): %w", errdefs.ErrFailedPrecondition)
	}
	prof := fuseprofile.Find(p.Profiles, name)
	if prof == nil {
		return nil, fmt.Errorf("fuse profile %q is not in this mounter's config: %w", name, errdefs.ErrInvalidArgument)
	}
	return prof, nil
}

// Command renders the command of spec from the policy's own profile of
// that name. It fails with FailedPrecondition when the policy has no
// profiles or the profile's binary is not an executable file here,
// InvalidArgument for a spec the profile refuses (a path source outside
// its roots included), NotFound for a path source that does not exist,
// and PermissionDenied for paths outside the roots. Errors never quote a
// secret: a spec holds none. It starts nothing and creates nothing.
func (p *Policy) Command(spec daemon.Spec) (daemon.Command, error) {
	prof, err := p.Profile(spec.Profile)
	if err != nil {
		return daemon.Command{}, err
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
	if fi, err := os.Stat(prof.Binary); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		return daemon.Command{}, fmt.Errorf("fuse profile %s: binary %s is not an executable file in the mounter: %w", prof.Name, prof.Binary, errdefs.ErrFailedPrecondition)
	}
	return c, nil
}

// checkPaths keeps a daemon's paths (clean and absolute, fuseprofile
// checked) below the roots.
func (p *Policy) checkPaths(ps daemon.Paths) error {
	for _, f := range []struct{ what, path string }{
		{"mount point", ps.MountPoint}, {"work dir", ps.WorkDir}, {"secrets dir", ps.SecretsDir}, {"log", ps.Log},
	} {
		if !plan.WithinAny(p.Roots, f.path) {
			return fmt.Errorf("daemon %s %s is outside the mounter's allowed roots: %w", f.what, f.path, errdefs.ErrPermissionDenied)
		}
	}
	return nil
}
