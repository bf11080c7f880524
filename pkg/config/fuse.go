package config

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

// FuseProfile is a FUSE daemon an admin allows; a volume picks one by name
// (volume_context profile=NAME) together with a source and the options the
// profile allows. Nothing a volume says can name a binary, add an argument
// or point at a host path outside the profile's source roots.
//
//	fuseProfiles:
//	- name: sshfs
//	  binary: /usr/bin/sshfs
//	  args: [-f, "{source}", "{mountpoint}", -F, /dev/null,
//	         -o, "IdentityFile={secret:sshKey}", "{options}"]
//	  source: {pattern: '[a-z_][a-z0-9_-]*@[A-Za-z0-9.-]+:[A-Za-z0-9._/~-]*'}
//	  options:
//	  - {name: port, pattern: '[0-9]{1,5}', args: [-p, "{value}"]}
//	  secrets:
//	  - {name: sshKey}
type FuseProfile struct {
	// Name is what volumes pick: lower-case letters, digits and dashes.
	Name string `json:"name"`
	// Binary is the daemon's absolute path. It must run in the foreground
	// (the process started is the one supervised) and mount at its
	// mount point argument.
	Binary string `json:"binary"`
	// Args is the argument template, one element per argument; a
	// placeholder never splits an element. Placeholders:
	//   {source}       the volume's source (checked against Source)
	//   {mountpoint}   where the daemon mounts (required, once)
	//   {workdir}      a private, empty directory of the volume (caches)
	//   {secret:NAME}  the path of the file holding a required secret
	//   {options}      alone in its element: the arguments of the chosen
	//                  options, then ReadOnlyArgs when the volume is
	//                  read-only, then the arguments of the optional
	//                  secrets given (appended at the end when absent)
	Args []string `json:"args"`
	// Source says what a volume's source may be.
	Source FuseSourceRule `json:"source"`
	// Options are the per-volume settings a volume may choose, each a
	// volume_context key of its own.
	Options []FuseOption `json:"options,omitempty"`
	// ReadOnlyArgs are added at {options} when the volume is staged
	// read-only (the plan's bind is read-only in any case).
	ReadOnlyArgs []string `json:"readOnlyArgs,omitempty"`
	// Secrets are the node-stage secrets the daemon takes. Each reaches it
	// as a file (mode 0600 in a tmpfs private to the volume) or as its
	// standard input; never on a command line or in an environment.
	Secrets []FuseSecret `json:"secrets,omitempty"`
	// Env is the daemon's environment besides PATH. Values are literal
	// and must not hold secrets: another process can read an environment.
	Env map[string]string `json:"env,omitempty"`
	// RunAs runs the daemon as this user and group instead of root. The
	// tool must then mount through fusermount3 (setuid), the state dir
	// must be traversable by that user, and allow_other needs
	// user_allow_other in /etc/fuse.conf.
	RunAs *FuseUser `json:"runAs,omitempty"`
	// ReadyTimeout bounds how long the FUSE mount may take to appear after
	// the daemon starts. Default 30s.
	ReadyTimeout Duration `json:"readyTimeout,omitempty"`
}

// FuseSourceRule constrains a volume's source: either a pattern (a remote
// such as user@host:/path) or a host path under one of Roots. Every source
// is also limited to the characters letters, digits and . _ @ : / + ~ % -,
// may not start with '-', and may not hold a ".." element.
type FuseSourceRule struct {
	// Pattern is an RE2 expression the whole source must match.
	Pattern string `json:"pattern,omitempty"`
	// Roots make the source a host path (absolute, clean) that must lie,
	// after resolving symlinks, under one of these directories.
	Roots []string `json:"roots,omitempty"`
}

// FuseOption is one per-volume setting.
type FuseOption struct {
	// Name is the volume_context key (letters and digits, starting with a
	// letter; not type, profile, source or fsType).
	Name string `json:"name"`
	// Values lists the accepted values, or
	Values []string `json:"values,omitempty"`
	// Pattern is an RE2 expression the whole value must match.
	Pattern string `json:"pattern,omitempty"`
	// Default is used when the volume does not set the option; empty: the
	// option's arguments are left out.
	Default string `json:"default,omitempty"`
	// Args are added at {options}; {value} is replaced by the value.
	Args []string `json:"args"`
}

// FuseSecret is a node-stage secret key the daemon takes.
type FuseSecret struct {
	// Name is the key in the node-stage secret and the file's name.
	Name string `json:"name"`
	// Optional secrets may be missing; their Args are then left out.
	Optional bool `json:"optional,omitempty"`
	// Stdin makes the file the daemon's standard input (at most one).
	Stdin bool `json:"stdin,omitempty"`
	// Args are added at {options} when the secret is given; {path} is
	// replaced by the file's path. Required secrets may instead be
	// referenced in the profile's Args as {secret:NAME}.
	Args []string `json:"args,omitempty"`
}

// FuseUser is a numeric user and group.
type FuseUser struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

// Duration is a time.Duration written as "10s" in the config file.
type Duration struct{ time.Duration }

// UnmarshalJSON parses "1m30s" and the like.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string such as \"30s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// Fuse volume_context keys that are not options.
var FuseReservedKeys = []string{"type", "profile", "source", "fsType"}

var (
	fuseProfileName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	fuseOptionName  = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9]{0,62}$`)
	fuseSecretName  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$`)
	fuseEnvName     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	fusePlaceholder = regexp.MustCompile(`\{[^{}]*\}`)
)

// FusePlaceholders finds the placeholders ({name} or {name:arg}) in s.
func FusePlaceholders(s string) []string { return fusePlaceholder.FindAllString(s, -1) }

// FuseProfileByName returns the profile called name, or nil.
func (c *Config) FuseProfileByName(name string) *FuseProfile {
	return FindFuseProfile(c.FuseProfiles, name)
}

// FindFuseProfile returns the profile of profiles called name, or nil.
func FindFuseProfile(profiles []FuseProfile, name string) *FuseProfile {
	for i := range profiles {
		if profiles[i].Name == name {
			return &profiles[i]
		}
	}
	return nil
}

// CompilePattern anchors an RE2 expression so that it must match a whole
// string.
func CompilePattern(p string) (*regexp.Regexp, error) {
	return regexp.Compile(`^(?:` + p + `)$`)
}

func (c *Config) validateFuse() error {
	seen := map[string]bool{}
	for i := range c.FuseProfiles {
		p := &c.FuseProfiles[i]
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

func (p *FuseProfile) validate() error {
	if !filepath.IsAbs(p.Binary) || filepath.Clean(p.Binary) != p.Binary {
		return invalidf("binary %q must be a clean absolute path", p.Binary)
	}
	if p.ReadyTimeout.Duration < 0 {
		return invalidf("readyTimeout must not be negative")
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
	for k := range p.Env {
		if !fuseEnvName.MatchString(k) || k == "PATH" {
			return invalidf("env: %q is not a settable variable name", k)
		}
	}
	return nil
}

// checkTemplate calls check for each placeholder in a and refuses stray
// braces and NUL bytes.
func checkTemplate(field, a string, check func(string) error) error {
	if strings.ContainsRune(a, 0) {
		return invalidf("%s: an argument holds a NUL byte", field)
	}
	for _, ph := range FusePlaceholders(a) {
		if err := check(ph); err != nil {
			return err
		}
	}
	if rest := fusePlaceholder.ReplaceAllString(a, ""); strings.ContainsAny(rest, "{}") {
		return invalidf("%s: %q has an unbalanced brace", field, a)
	}
	return nil
}

func (r FuseSourceRule) validate() error {
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

func (p *FuseProfile) validateSecrets() (map[string]FuseSecret, error) {
	byName := map[string]FuseSecret{}
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
			if err := checkTemplate("secrets["+s.Name+"].args", a, func(ph string) error {
				if ph != "{path}" {
					return invalidf("secrets[%s].args: only {path} is allowed, not %s", s.Name, ph)
				}
				return nil
			}); err != nil {
				return nil, err
			}
		}
	}
	if stdin > 1 {
		return nil, invalidf("at most one secret may be the daemon's standard input")
	}
	return byName, nil
}

func (p *FuseProfile) validateOptions() error {
	seen := map[string]bool{}
	for i, o := range p.Options {
		if !fuseOptionName.MatchString(o.Name) || slices.Contains(FuseReservedKeys, o.Name) {
			return invalidf("options[%d]: name %q must be letters and digits and not one of %v", i, o.Name, FuseReservedKeys)
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
			if err := checkTemplate("options["+o.Name+"].args", a, func(ph string) error {
				if ph != "{value}" {
					return invalidf("options[%s].args: only {value} is allowed, not %s", o.Name, ph)
				}
				return nil
			}); err != nil {
				return err
			}
		}
	}
	return nil
}

// fuseWord is what every source and option value is limited to, whatever
// the profile allows: no shell metacharacters, no spaces, no commas (which
// would add options to a "-o a,b" list), no '=' and no braces.
var fuseWord = regexp.MustCompile(`^[A-Za-z0-9._@:/+~%-]+$`)

// CheckFuseWord checks a volume-supplied string that becomes (part of) a
// daemon argument: at most 1024 characters from the safe set, not starting
// with '-' (it would be read as a flag) and without a ".." element.
// Errors quote the value: sources and options are not secret.
func CheckFuseWord(what, s string) error {
	switch {
	case len(s) > 1024:
		return invalidf("%s is longer than 1024 characters", what)
	case !fuseWord.MatchString(s):
		return invalidf("%s %q may only hold letters, digits and . _ @ : / + ~ %% -", what, s)
	case strings.HasPrefix(s, "-"):
		return invalidf("%s %q must not start with '-'", what, s)
	case slices.Contains(strings.FieldsFunc(s, func(r rune) bool { return r == '/' || r == ':' }), ".."):
		return invalidf("%s %q must not hold a \"..\" element", what, s)
	}
	return nil
}

// Check reports whether v is a value the option accepts.
func (o FuseOption) Check(v string) error {
	if err := CheckFuseWord("option "+o.Name, v); err != nil {
		return err
	}
	if len(o.Values) > 0 {
		if !slices.Contains(o.Values, v) {
			return invalidf("option %s: %q is not one of %v", o.Name, v, o.Values)
		}
		return nil
	}
	re, err := CompilePattern(o.Pattern)
	if err != nil {
		return invalidf("option %s: pattern: %v", o.Name, err)
	}
	if !re.MatchString(v) {
		return invalidf("option %s: %q does not match %s", o.Name, v, o.Pattern)
	}
	return nil
}
