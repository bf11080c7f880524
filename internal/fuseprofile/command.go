package fuseprofile

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Command renders the daemon's command line for spec from profile p: the
// binary, the arguments of p's template, the environment (a fixed PATH and
// p's values), standard input and user. source is spec's source as the
// daemon gets it (ResolveSource of a path source). Nothing of the command
// comes from anywhere but p, spec's checked parameters and spec's paths,
// and the result carries spec so that a spawner that trusts no caller can
// render it again. It touches nothing on the host.
func (p *Profile) Command(spec daemon.Spec, source string) (daemon.Command, error) {
	if spec.Profile != p.Name {
		return daemon.Command{}, invalidf("spec names fuse profile %q, not %q", spec.Profile, p.Name)
	}
	params, _, err := VolumeParams([]Profile{*p}, spec.Params)
	if err != nil {
		return daemon.Command{}, err
	}
	if err := p.CheckSecretNames(spec.Secrets); err != nil {
		return daemon.Command{}, err
	}
	if err := checkPaths(spec.Paths); err != nil {
		return daemon.Command{}, err
	}
	if err := CheckWord("resolved source", source); err != nil {
		return daemon.Command{}, err
	}
	args, stdin, err := p.render(params, source, spec)
	if err != nil {
		return daemon.Command{}, err
	}
	env := p.env()
	if err := CheckEnv(env); err != nil {
		return daemon.Command{}, fmt.Errorf("fuse profile %s: %w", p.Name, err)
	}
	caps, err := p.DaemonCapabilities()
	if err != nil {
		return daemon.Command{}, err
	}
	s := spec
	s.Params = maps.Clone(params)
	s.Secrets = slices.Sorted(slices.Values(spec.Secrets))
	return daemon.Command{Path: p.Binary, Args: args, Env: env, Stdin: stdin, Log: spec.Paths.Log, RunAs: p.DaemonUser(),
		Capabilities: caps, Spec: &s}, nil
}

// DaemonCapabilities are the capabilities p's daemons keep: none in fd
// mode (the mounter mounts), else p's list (canonical), or
// daemon.DefaultCapabilities when p names none.
func (p *Profile) DaemonCapabilities() ([]string, error) {
	if p.FdMount {
		return []string{}, nil
	}
	if p.Capabilities == nil {
		return slices.Clone(daemon.DefaultCapabilities), nil
	}
	caps, err := daemon.ParseCapabilities(p.Capabilities)
	if err != nil {
		return nil, fmt.Errorf("fuse profile %s: %w", p.Name, err)
	}
	return caps, nil
}

// checkPaths accepts clean absolute paths from the safe character set: a
// path becomes part of an argument (IdentityFile=<secrets dir>/key inside a
// "-o" list), where a comma or a '=' would add options of its own.
func checkPaths(ps daemon.Paths) error {
	for _, f := range []struct{ what, path string }{
		{"mount point", ps.MountPoint}, {"work dir", ps.WorkDir}, {"secrets dir", ps.SecretsDir}, {"log", ps.Log},
	} {
		if !plan.IsCleanAbs(f.path) || f.path == "/" {
			return invalidf("daemon %s %q must be a clean absolute path other than /", f.what, f.path)
		}
		if err := CheckWord("daemon "+f.what, f.path); err != nil {
			return err
		}
	}
	return nil
}

// render fills p's argument template.
func (p *Profile) render(params map[string]string, source string, spec daemon.Spec) (args []string, stdin string, err error) {
	var opts []string
	for _, o := range p.Options {
		val, ok := params[o.Name]
		if !ok {
			val = o.Default
		}
		if val == "" {
			continue
		}
		for _, a := range o.Args {
			opts = append(opts, strings.ReplaceAll(a, "{value}", val))
		}
	}
	if spec.ReadOnly {
		opts = append(opts, p.ReadOnlyArgs...)
	}
	if spec.MountGroup != nil {
		gid := strconv.FormatUint(uint64(*spec.MountGroup), 10)
		for _, a := range p.MountGroupArgs {
			opts = append(opts, strings.ReplaceAll(a, "{gid}", gid))
		}
	}
	for _, s := range p.Secrets {
		if !slices.Contains(spec.Secrets, s.Name) {
			continue
		}
		file := filepath.Join(spec.Paths.SecretsDir, s.Name)
		if s.Stdin {
			stdin = file
		}
		for _, a := range s.Args {
			opts = append(opts, strings.ReplaceAll(a, "{path}", file))
		}
	}
	placed := false
	for _, a := range p.Args {
		if a == "{options}" {
			args = append(args, opts...)
			placed = true
			continue
		}
		out := a
		for _, ph := range Placeholders(a) {
			var v string
			switch {
			case ph == "{source}":
				v = source
			case ph == "{mountpoint}" && p.FdMount:
				// The mounter mounted at spec.Paths.MountPoint already.
				v = FdMountPoint
			case ph == "{mountpoint}":
				v = spec.Paths.MountPoint
			case ph == "{workdir}":
				v = spec.Paths.WorkDir
			case strings.HasPrefix(ph, "{secret:"):
				v = filepath.Join(spec.Paths.SecretsDir, strings.TrimSuffix(strings.TrimPrefix(ph, "{secret:"), "}"))
			default:
				return nil, "", invalidf("fuse profile %s: unknown placeholder %s", p.Name, ph)
			}
			out = strings.Replace(out, ph, v, 1)
		}
		args = append(args, out)
	}
	if !placed {
		args = append(args, opts...)
	}
	return args, stdin, nil
}

// daemonPATH is the PATH every daemon gets.
const daemonPATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// env is the daemon's environment: a fixed PATH and the profile's values.
func (p *Profile) env() []string {
	out := []string{daemonPATH}
	for _, k := range slices.Sorted(maps.Keys(p.Env)) {
		out = append(out, k+"="+p.Env[k])
	}
	return out
}
