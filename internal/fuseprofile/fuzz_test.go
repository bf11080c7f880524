package fuseprofile

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
)

// FuzzCommand renders the test profile with what a volume (or a plugin
// that the mounter does not trust) may choose: the source, an option's
// value, another key, the secrets given, the paths. Whatever it accepts
// has exactly the argument count the template gives, every argument that
// is not the profile's own text holds no comma and does not start with a
// dash (no argument and no "-o" option of the caller's making), and the
// environment is the profile's.
func FuzzCommand(f *testing.F) {
	f.Add("u@h:/d", "port", "2222", "key", "/st/fuse/v/mnt", "/st/fuse/v/secrets", false)
	f.Add("u@h:/d", "mode", "b", "key\nca", "/st/fuse/v/mnt", "/st/fuse/v/secrets", true)
	f.Add("u@h:/d", "port", "22,ssh_command=/tmp/x", "key", "/st/mnt", "/st/secrets", false)
	f.Add("-oProxyCommand=x", "ssh_command", "/tmp/x", "key\npass", "-f", "/st/x,ssh_command=y", true)
	f.Add("u@h:/d", "profile", "other", "", "/st/mnt", "/st/../etc", false)
	p := testProfile()
	shapes := profileShapes(p)
	f.Fuzz(func(t *testing.T, source, key, val, secrets, mountPoint, secretsDir string, readOnly bool) {
		spec := daemon.Spec{Profile: p.Name, Params: map[string]string{"profile": p.Name, "source": source, key: val}, ReadOnly: readOnly,
			Paths: daemon.Paths{MountPoint: mountPoint, WorkDir: "/st/fuse/v/work", SecretsDir: secretsDir, Log: "/st/fuse/v/daemon.log"}}
		if secrets != "" {
			spec.Secrets = strings.Split(secrets, "\n")
		}
		c, err := p.Command(spec, source)
		if err != nil {
			return
		}
		if want := argCount(p, c.Spec); len(c.Args) != want {
			t.Fatalf("%d arguments, the template gives %d: %q", len(c.Args), want, c.Args)
		}
		for _, a := range c.Args {
			if !slices.ContainsFunc(shapes, func(re *regexp.Regexp) bool { return re.MatchString(a) }) {
				t.Fatalf("argument %q is of the caller's making (spec %+v)", a, spec)
			}
		}
		if !slices.Equal(c.Env, p.env()) || c.Path != p.Binary || c.RunAs != p.RunAs {
			t.Fatalf("command %+v is not the profile's", c)
		}
	})
}

// profileShapes is what an argument of the profile may look like: each
// of its argument templates (elements, option, secret and read-only
// arguments) with every placeholder standing for a value that holds no
// comma, space or NUL, and does not start with a dash where the template
// starts with the placeholder.
func profileShapes(p *Profile) []*regexp.Regexp {
	var all []string
	all = append(all, p.Args...)
	all = append(all, p.ReadOnlyArgs...)
	for _, o := range p.Options {
		all = append(all, o.Args...)
	}
	for _, s := range p.Secrets {
		all = append(all, s.Args...)
	}
	var out []*regexp.Regexp
	for _, a := range all {
		expr := regexp.QuoteMeta(a)
		for _, ph := range Placeholders(a) {
			expr = strings.Replace(expr, regexp.QuoteMeta(ph), `[^,\s\x00]+`, 1)
		}
		expr = strings.Replace("^"+expr+"$", `^[^,\s\x00]+`, `^[^-,\s\x00][^,\s\x00]*`, 1)
		out = append(out, regexp.MustCompile(expr))
	}
	return out
}

// argCount is how many arguments the template gives spec: its elements
// but {options}, each chosen (or defaulted) option's, the read-only ones
// and each given secret's.
func argCount(p *Profile, spec *daemon.Spec) int {
	n := 0
	for _, a := range p.Args {
		if a != "{options}" {
			n++
		}
	}
	for _, o := range p.Options {
		if v, ok := spec.Params[o.Name]; (ok && v != "") || (!ok && o.Default != "") {
			n += len(o.Args)
		}
	}
	if spec.ReadOnly {
		n += len(p.ReadOnlyArgs)
	}
	for _, s := range p.Secrets {
		if slices.Contains(spec.Secrets, s.Name) {
			n += len(s.Args)
		}
	}
	return n
}
