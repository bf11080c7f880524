package fuse

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Volume context keys of a FUSE volume. Every other key without a '/'
// (keys with one are added by Kubernetes) names an option of the profile.
const (
	CtxProfile = "profile"
	CtxSource  = "source"
)

func invalid(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

// checkContext checks a volume's context against the admin's profiles and
// returns the parameters to keep: profile, source and the options the
// volume set. Nothing is started and nothing on the host is touched.
func checkContext(profiles []config.FuseProfile, vctx map[string]string) (map[string]string, *config.FuseProfile, error) {
	name := vctx[CtxProfile]
	if name == "" {
		return nil, nil, invalid("a fuse volume needs a %q attribute naming one of the admin's profiles", CtxProfile)
	}
	p := config.FindFuseProfile(profiles, name)
	if p == nil {
		return nil, nil, invalid("fuse profile %q is not defined by the admin (defined: %s)", name, strings.Join(profileNames(profiles), ", "))
	}
	params := map[string]string{CtxProfile: name}
	keys := slices.Sorted(maps.Keys(vctx))
	for _, k := range keys {
		val := vctx[k]
		switch {
		case strings.Contains(k, "/") || k == "type" || k == "fsType" || k == CtxProfile:
			// Kubernetes' own keys; type and fsType mean nothing here.
		case k == CtxSource:
			if err := checkSource(p, val); err != nil {
				return nil, nil, err
			}
			params[k] = val
		default:
			i := slices.IndexFunc(p.Options, func(o config.FuseOption) bool { return o.Name == k })
			if i < 0 {
				return nil, nil, invalid("fuse profile %s allows no option %q (allowed: %s)", name, k, strings.Join(optionNames(p), ", "))
			}
			if err := p.Options[i].Check(val); err != nil {
				return nil, nil, fmt.Errorf("fuse profile %s: %w", name, err)
			}
			params[k] = val
		}
	}
	if _, ok := params[CtxSource]; !ok {
		return nil, nil, invalid("a fuse volume needs a %q attribute", CtxSource)
	}
	return params, p, nil
}

func profileNames(profiles []config.FuseProfile) []string {
	names := make([]string, 0, len(profiles))
	for _, p := range profiles {
		names = append(names, p.Name)
	}
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}

func optionNames(p *config.FuseProfile) []string {
	names := make([]string, 0, len(p.Options))
	for _, o := range p.Options {
		names = append(names, o.Name)
	}
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}

// checkSource applies the safe character set and the profile's rule, without
// touching the host (path sources are resolved at stage time).
func checkSource(p *config.FuseProfile, src string) error {
	if err := config.CheckFuseWord("source", src); err != nil {
		return err
	}
	if len(p.Source.Roots) > 0 {
		if !filepath.IsAbs(src) || filepath.Clean(src) != src {
			return invalid("source %q must be a clean absolute path", src)
		}
		return nil
	}
	re, err := config.CompilePattern(p.Source.Pattern)
	if err != nil {
		return invalid("fuse profile %s: source pattern: %v", p.Name, err)
	}
	if !re.MatchString(src) {
		return invalid("source %q does not match what fuse profile %s allows (%s)", src, p.Name, p.Source.Pattern)
	}
	return nil
}

// resolveSource turns a path source into the real path under one of the
// profile's roots; other sources pass unchanged.
func resolveSource(p *config.FuseProfile, src string) (string, error) {
	if len(p.Source.Roots) == 0 {
		return src, nil
	}
	real, inside, err := plan.ResolveUnder(src, p.Source.Roots)
	if err != nil {
		return "", fmt.Errorf("source %w", err)
	}
	if !inside {
		return "", invalid("source %s is outside the roots of fuse profile %s", src, p.Name)
	}
	return real, nil
}

// paths are where a volume's daemon works.
type paths struct {
	mountPoint, workDir, secretsDir string
}

// render builds the daemon's arguments. given holds the names of the
// secrets the stage request carried.
func render(p *config.FuseProfile, params map[string]string, source string, at paths, readOnly bool, given map[string]bool) (args []string, stdin string, err error) {
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
	if readOnly {
		opts = append(opts, p.ReadOnlyArgs...)
	}
	for _, s := range p.Secrets {
		if !given[s.Name] {
			continue
		}
		file := filepath.Join(at.secretsDir, s.Name)
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
		for _, ph := range config.FusePlaceholders(a) {
			var v string
			switch {
			case ph == "{source}":
				v = source
			case ph == "{mountpoint}":
				v = at.mountPoint
			case ph == "{workdir}":
				v = at.workDir
			case strings.HasPrefix(ph, "{secret:"):
				v = filepath.Join(at.secretsDir, strings.TrimSuffix(strings.TrimPrefix(ph, "{secret:"), "}"))
			default:
				return nil, "", invalid("fuse profile %s: unknown placeholder %s", p.Name, ph)
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

// checkSecrets makes sure the stage request carries every required secret
// of the profile and nothing else. Errors name keys, never values.
func checkSecrets(p *config.FuseProfile, secrets map[string]string) (map[string]bool, error) {
	given := map[string]bool{}
	var unknown []string
	for k := range secrets {
		if !slices.ContainsFunc(p.Secrets, func(s config.FuseSecret) bool { return s.Name == k }) {
			unknown = append(unknown, k)
			continue
		}
		given[k] = true
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return nil, invalid("fuse profile %s takes no secret %s", p.Name, strings.Join(unknown, ", "))
	}
	for _, s := range p.Secrets {
		if !s.Optional && !given[s.Name] {
			return nil, invalid("fuse profile %s needs the secret %q in the node-stage secret", p.Name, s.Name)
		}
		if given[s.Name] && len(secrets[s.Name]) > maxSecret {
			return nil, invalid("secret %q is larger than %d bytes", s.Name, maxSecret)
		}
	}
	return given, nil
}

// env is the daemon's environment: a fixed PATH and the profile's values.
func env(p *config.FuseProfile) []string {
	out := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, k := range slices.Sorted(maps.Keys(p.Env)) {
		out = append(out, k+"="+p.Env[k])
	}
	return out
}

// runAs is the daemon's user of a profile (nil: root).
func runAs(u *config.FuseUser) *daemon.User {
	if u == nil {
		return nil
	}
	return &daemon.User{UID: u.UID, GID: u.GID}
}
