package fuseprofile

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/pkg/plan"
)

// fuseWord is what every source and option value is limited to, whatever
// the profile allows: no shell metacharacters, no spaces, no commas (which
// would add options to a "-o a,b" list), no '=' and no braces.
var fuseWord = regexp.MustCompile(`^[A-Za-z0-9._@:/+~%-]+$`)

// CheckWord checks a volume-supplied string that becomes (part of) a
// daemon argument: at most 1024 characters from the safe set, not starting
// with '-' (it would be read as a flag) and without a ".." element.
// Errors quote the value: sources and options are not secret.
func CheckWord(what, s string) error {
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
func (o Option) Check(v string) error {
	if err := CheckWord("option "+o.Name, v); err != nil {
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

// Volume context keys of a FUSE volume. Every other key without a '/'
// (keys with one are added by Kubernetes) names an option of the profile.
const (
	CtxProfile = "profile"
	CtxSource  = "source"
)

// VolumeParams checks a volume's context against the admin's profiles and
// returns the parameters to keep (profile, source and the options the
// volume set) and the profile they name. Parameters it returned pass it
// again unchanged, which is how the mounter checks what the plugin sends.
// Nothing is started and nothing on the host is touched.
func VolumeParams(profiles []Profile, vctx map[string]string) (map[string]string, *Profile, error) {
	name := vctx[CtxProfile]
	if name == "" {
		return nil, nil, invalidf("a fuse volume needs a %q attribute naming one of the admin's profiles", CtxProfile)
	}
	p := Find(profiles, name)
	if p == nil {
		return nil, nil, invalidf("fuse profile %q is not defined by the admin (defined: %s)", name, strings.Join(profileNames(profiles), ", "))
	}
	params := map[string]string{CtxProfile: name}
	for _, k := range slices.Sorted(maps.Keys(vctx)) {
		val := vctx[k]
		switch {
		case strings.Contains(k, "/") || k == "type" || k == "fsType" || k == CtxProfile:
			// Kubernetes' own keys; type and fsType mean nothing here.
		case k == CtxSource:
			if err := p.checkSource(val); err != nil {
				return nil, nil, err
			}
			params[k] = val
		default:
			i := slices.IndexFunc(p.Options, func(o Option) bool { return o.Name == k })
			if i < 0 {
				return nil, nil, invalidf("fuse profile %s allows no option %q (allowed: %s)", name, k, strings.Join(optionNames(p), ", "))
			}
			if err := p.Options[i].Check(val); err != nil {
				return nil, nil, fmt.Errorf("fuse profile %s: %w", name, err)
			}
			params[k] = val
		}
	}
	if _, ok := params[CtxSource]; !ok {
		return nil, nil, invalidf("a fuse volume needs a %q attribute", CtxSource)
	}
	return params, p, nil
}

func profileNames(profiles []Profile) []string {
	names := make([]string, 0, len(profiles))
	for _, p := range profiles {
		names = append(names, p.Name)
	}
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}

func optionNames(p *Profile) []string {
	names := make([]string, 0, len(p.Options))
	for _, o := range p.Options {
		names = append(names, o.Name)
	}
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}

// checkSource applies the safe character set and the profile's rule,
// without touching the host (a path source is resolved by ResolveSource).
func (p *Profile) checkSource(src string) error {
	if err := CheckWord("source", src); err != nil {
		return err
	}
	if len(p.Source.Roots) > 0 {
		if !plan.IsCleanAbs(src) {
			return invalidf("source %q must be a clean absolute path", src)
		}
		return nil
	}
	re, err := CompilePattern(p.Source.Pattern)
	if err != nil {
		return invalidf("fuse profile %s: source pattern: %v", p.Name, err)
	}
	if !re.MatchString(src) {
		return invalidf("source %q does not match what fuse profile %s allows (%s)", src, p.Name, p.Source.Pattern)
	}
	return nil
}

// ResolveSource turns a path source into the real path under one of the
// profile's roots, symlinks resolved (a symlink under a root may point
// anywhere); other sources pass unchanged. A path that does not exist
// wraps errdefs.ErrNotFound.
func (p *Profile) ResolveSource(src string) (string, error) {
	if len(p.Source.Roots) == 0 {
		return src, nil
	}
	real, inside, err := plan.ResolveUnder(src, p.Source.Roots)
	if err != nil {
		return "", fmt.Errorf("source %w", err)
	}
	if !inside {
		return "", invalidf("source %s is outside the roots of fuse profile %s", src, p.Name)
	}
	return real, nil
}

// CheckSecretNames checks the names of the secrets a volume was given:
// every required secret of the profile and nothing else. Errors name keys,
// never values.
func (p *Profile) CheckSecretNames(names []string) error {
	var unknown []string
	for _, n := range names {
		if !slices.ContainsFunc(p.Secrets, func(s Secret) bool { return s.Name == n }) {
			unknown = append(unknown, n)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return invalidf("fuse profile %s takes no secret %s", p.Name, strings.Join(unknown, ", "))
	}
	for _, s := range p.Secrets {
		if !s.Optional && !slices.Contains(names, s.Name) {
			return invalidf("fuse profile %s needs the secret %q in the node-stage secret", p.Name, s.Name)
		}
	}
	return nil
}
