package fuseprofile

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
)

// Validate checks an admin's profiles (the config's fuseProfiles): names,
// templates, patterns, secrets and environment. Errors wrap
// errdefs.ErrInvalidArgument and name the profile.
func Validate(profiles []Profile) error {
	seen := map[string]bool{}
	for i := range profiles {
		p := &profiles[i]
		if !fuseProfileName.MatchString(p.Name) {
			return fuseErr(i, "name %q must be lower-case letters, digits and dashes", p.Name)
		}
		if seen[p.Name] {
			return fuseErr(i, "name %q is used twice", p.Name)
		}
		seen[p.Name] = true
		if err := p.validate(); err != nil {
			return fmt.Errorf("fuseProfiles[%d] (%s): %w", i, p.Name, err)
		}
	}
	return nil
}

func fuseErr(i int, format string, args ...any) error {
	return fmt.Errorf("fuseProfiles[%d]: "+format+": %w", append(append([]any{i}, args...), errdefs.ErrInvalidArgument)...)
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

func (p *Profile) validate() error {
	if !filepath.IsAbs(p.Binary) || filepath.Clean(p.Binary) != p.Binary {
		return invalidf("binary %q must be a clean absolute path", p.Binary)
	}
	if _, err := daemon.ParseCapabilities(p.Capabilities); err != nil {
		return invalidf("capabilities: %v", err)
	}
	if err := p.validateFdMount(); err != nil {
		return err
	}
	if p.ReadyTimeout.Duration < 0 {
		return invalidf("readyTimeout must not be negative")
	}
	if _, err := p.Resources.Limits(); err != nil {
		return invalidf("%v", err)
	}
	if err := p.Source.validate(); err != nil {
		return err
	}
	secrets, err := p.validateSecrets()
	if err != nil {
		return err
	}
	if err := p.validateOptions(); err != nil {
		return err
	}
	counts := map[string]int{}
	for _, a := range p.Args {
		if err := checkTemplate("args", a, func(ph string) error {
			switch {
			case ph == "{source}" || ph == "{mountpoint}" || ph == "{workdir}":
			case ph == "{options}":
				if a != ph {
					return invalidf("args: {options} must be an element of its own, not part of %q", a)
				}
			case strings.HasPrefix(ph, "{secret:"):
				name := strings.TrimSuffix(strings.TrimPrefix(ph, "{secret:"), "}")
				s, ok := secrets[name]
				if !ok {
					return invalidf("args: %s names no secret of the profile", ph)
				}
				if s.Optional {
					return invalidf("args: %s names an optional secret; put it in that secret's args", ph)
				}
			default:
				return invalidf("args: unknown placeholder %s", ph)
			}
			counts[ph]++
			return nil
		}); err != nil {
			return err
		}
	}
	if counts["{mountpoint}"] != 1 {
		return invalidf("args must hold {mountpoint} exactly once")
	}
	if counts["{options}"] > 1 {
		return invalidf("args may hold {options} once")
	}
	for _, a := range p.ReadOnlyArgs {
		if err := checkTemplate("readOnlyArgs", a, func(ph string) error {
			return invalidf("readOnlyArgs: placeholder %s is not allowed", ph)
		}); err != nil {
			return err
		}
	}
	for _, a := range p.MountGroupArgs {
		if err := checkTemplate("mountGroupArgs", a, func(ph string) error {
			if ph != "{gid}" {
				return invalidf("mountGroupArgs: placeholder %s is not allowed (only {gid})", ph)
			}
			return nil
		}); err != nil {
			return err
		}
	}
	for k, v := range p.Env {
		if k == "PATH" {
			return invalidf("env: PATH is fixed")
		}
		if err := checkEnvEntry(k + "=" + v); err != nil {
			return invalidf("env: %v", err)
		}
	}
	return nil
}

// onlyPlaceholder is a checkTemplate check that accepts one placeholder,
// allowed, in field's arguments.
func onlyPlaceholder(field, allowed string) func(ph string) error {
	return func(ph string) error {
		if ph != allowed {
			return invalidf("%s: only %s is allowed, not %s", field, allowed, ph)
		}
		return nil
	}
}

// checkTemplate calls check for each placeholder in a and refuses stray
// braces and NUL bytes.
func checkTemplate(field, a string, check func(string) error) error {
	if strings.ContainsRune(a, 0) {
		return invalidf("%s: an argument holds a NUL byte", field)
	}
	for _, ph := range Placeholders(a) {
		if err := check(ph); err != nil {
			return err
		}
	}
	if rest := fusePlaceholder.ReplaceAllString(a, ""); strings.ContainsAny(rest, "{}") {
		return invalidf("%s: %q has an unbalanced brace", field, a)
	}
	return nil
}

func (r SourceRule) validate() error {
	if (r.Pattern == "") == (len(r.Roots) == 0) {
		return invalidf("source needs either a pattern or roots")
	}
	if r.Pattern != "" {
		if _, err := CompilePattern(r.Pattern); err != nil {
			return invalidf("source.pattern: %v", err)
		}
	}
	for i, root := range r.Roots {
		if !filepath.IsAbs(root) || filepath.Clean(root) != root || root == "/" {
			return invalidf("source.roots[%d] %q must be a clean absolute path other than /", i, root)
		}
	}
	return nil
}

func (p *Profile) validateSecrets() (map[string]Secret, error) {
	byName := map[string]Secret{}
	stdin := 0
	for i, s := range p.Secrets {
		if !fuseSecretName.MatchString(s.Name) {
			return nil, invalidf("secrets[%d]: name %q must be letters, digits, '_' and '-'", i, s.Name)
		}
		if _, dup := byName[s.Name]; dup {
			return nil, invalidf("secrets[%d]: %q is declared twice", i, s.Name)
		}
		byName[s.Name] = s
		if s.Stdin {
			stdin++
		}
		for _, a := range s.Args {
			field := "secrets[" + s.Name + "].args"
			if err := checkTemplate(field, a, onlyPlaceholder(field, "{path}")); err != nil {
				return nil, err
			}
		}
	}
	if stdin > 1 {
		return nil, invalidf("at most one secret may be the daemon's standard input")
	}
	return byName, nil
}

// SecretsReadableByRoot reports whether p takes secrets and runs its
// daemon as root (no runAs outside fd mode, or uid or gid 0): the secrets' files then
// belong to root, and the plugin, root in its container, can read them
// where it reaches them (review of b705b24, F3). A daemon of its own user
// owns its secrets (mode 0600 in a 0700 tmpfs), which root without
// CAP_DAC_OVERRIDE cannot read. Not refused: a daemon that mounts through
// fusermount as another user needs user_allow_other in the image's
// /etc/fuse.conf for allow_other (rclone does); the mounter warns instead.
func (p *Profile) SecretsReadableByRoot() bool {
	u := p.DaemonUser()
	return len(p.Secrets) > 0 && (u == nil || u.UID == 0 || u.GID == 0)
}

func (p *Profile) validateOptions() error {
	seen := map[string]bool{}
	for i, o := range p.Options {
		if !fuseOptionName.MatchString(o.Name) || slices.Contains(ReservedKeys, o.Name) {
			return invalidf("options[%d]: name %q must be letters and digits and not one of %v", i, o.Name, ReservedKeys)
		}
		if seen[o.Name] {
			return invalidf("options[%d]: %q is declared twice", i, o.Name)
		}
		seen[o.Name] = true
		if (len(o.Values) == 0) == (o.Pattern == "") {
			return invalidf("options[%d] (%s): needs either values or a pattern", i, o.Name)
		}
		if o.Pattern != "" {
			if _, err := CompilePattern(o.Pattern); err != nil {
				return invalidf("options[%d] (%s): pattern: %v", i, o.Name, err)
			}
		}
		if len(o.Args) == 0 {
			return invalidf("options[%d] (%s): args are required", i, o.Name)
		}
		if o.Default != "" {
			if err := o.Check(o.Default); err != nil {
				return fmt.Errorf("options[%d] (%s): default: %w", i, o.Name, err)
			}
		}
		for _, a := range o.Args {
			field := "options[" + o.Name + "].args"
			if err := checkTemplate(field, a, onlyPlaceholder(field, "{value}")); err != nil {
				return err
			}
		}
	}
	return nil
}

// loaderVars are the variables through which the dynamic loader or the C
// library of a process can be made to load code or read files of someone
// else's choosing (glibc's list of variables it drops for setuid programs,
// but TMPDIR). Any name starting with LD_ is one too.
var loaderVars = []string{
	"GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
	"MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_PERTURB_", "MALLOC_TRACE", "MALLOC_CHECK_",
	"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_",
	"NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
}

// IsLoaderVar reports whether the environment variable name can make a
// process load code or files: LD_* and loaderVars.
func IsLoaderVar(name string) bool {
	return strings.HasPrefix(name, "LD_") || slices.Contains(loaderVars, name)
}

// CheckEnv accepts an environment of KEY=VALUE entries with settable names
// and no loader variable (IsLoaderVar), each name once.
func CheckEnv(env []string) error {
	seen := map[string]bool{}
	for _, e := range env {
		if err := checkEnvEntry(e); err != nil {
			return err
		}
		k, _, _ := strings.Cut(e, "=")
		if seen[k] {
			return invalidf("environment variable %s is set twice", k)
		}
		seen[k] = true
	}
	return nil
}

// checkEnvEntry accepts KEY=VALUE with a settable name that is no loader
// variable and no NUL byte. Errors name the variable, never its value.
func checkEnvEntry(e string) error {
	k, _, ok := strings.Cut(e, "=")
	switch {
	case !ok || !fuseEnvName.MatchString(k):
		return invalidf("environment entry %q is not KEY=VALUE with a variable name", k)
	case strings.ContainsRune(e, 0):
		return invalidf("environment variable %s holds a NUL byte", k)
	case IsLoaderVar(k):
		return invalidf("environment variable %s can make the daemon load code or files; it is never set", k)
	}
	return nil
}
