package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

const fuseBase = `fuseProfiles:
- name: sshfs
  binary: /usr/bin/sshfs
  args: [-f, "{source}", "{mountpoint}", -o, "IdentityFile={secret:key}", "{options}"]
  source: {pattern: '[a-z]+@[a-z0-9.]+:[a-z/]*'}
  options:
  - {name: port, pattern: '[0-9]{1,5}', default: "22", args: [-p, "{value}"]}
  secrets:
  - {name: key}
  - {name: password, optional: true, stdin: true, args: [-o, password_stdin]}
  readyTimeout: 15s
`

func loadFuse(t *testing.T, yaml string) (*Config, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return Load(p)
}

func TestFuseProfilesLoad(t *testing.T) {
	c, err := loadFuse(t, fuseBase)
	if err != nil {
		t.Fatal(err)
	}
	p := c.FuseProfileByName("sshfs")
	if p == nil || p.ReadyTimeout.Duration != 15*time.Second || len(p.Secrets) != 2 || !p.Secrets[1].Stdin || p.Options[0].Default != "22" {
		t.Fatalf("parsed: %+v", p)
	}
	if c.FuseProfileByName("nfs") != nil {
		t.Error("found a profile that is not there")
	}
}

// The example profiles that README documents and the e2e tests run.
func TestFuseExampleProfilesLoad(t *testing.T) {
	c, err := Load(filepath.Join("..", "source", "fuse", "testdata", "profiles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"sshfs", "rclone", "squashfuse"} {
		if c.FuseProfileByName(n) == nil {
			t.Errorf("example profile %s missing", n)
		}
	}
}

func TestFuseProfilesInvalid(t *testing.T) {
	cases := map[string]struct{ from, to string }{
		"bad name":                         {"name: sshfs", "name: SSH_fs"},
		"relative binary":                  {"binary: /usr/bin/sshfs", "binary: sshfs"},
		"unclean binary":                   {"binary: /usr/bin/sshfs", "binary: /usr/bin/../bin/sshfs"},
		"no mountpoint":                    {`"{mountpoint}", `, ""},
		"two mountpoints":                  {`"{mountpoint}", `, `"{mountpoint}", "{mountpoint}", `},
		"unknown placeholder":              {`"{source}"`, `"{host}"`},
		"options inside an arg":            {`"{options}"`, `"x{options}"`},
		"unbalanced brace":                 {`"{source}"`, `"{source"`},
		"undeclared secret":                {"{secret:key}", "{secret:nokey}"},
		"optional secret in args":          {"{secret:key}", "{secret:password}"},
		"no source rule":                   {"source: {pattern: '[a-z]+@[a-z0-9.]+:[a-z/]*'}", "source: {}"},
		"both source rules":                {"source: {pattern: '[a-z]+@[a-z0-9.]+:[a-z/]*'}", "source: {pattern: x, roots: [/srv]}"},
		"bad source pattern":               {"'[a-z]+@[a-z0-9.]+:[a-z/]*'", "'[a-z'"},
		"relative source root":             {"source: {pattern: '[a-z]+@[a-z0-9.]+:[a-z/]*'}", "source: {roots: [srv]}"},
		"reserved option name":             {"name: port,", "name: source,"},
		"option without rule":              {"pattern: '[0-9]{1,5}', ", ""},
		"option without args":              {`args: [-p, "{value}"]`, "args: []"},
		"bad default":                      {`default: "22"`, `default: "x"`},
		"other placeholder in option args": {`"{value}"`, `"{source}"`},
		"two stdin secrets":                {"- {name: key}", "- {name: key, stdin: true}"},
		"unknown field":                    {"readyTimeout: 15s", "readyTimeout: 15s\n  timeout: 3s"},
		"bad duration":                     {"readyTimeout: 15s", "readyTimeout: soon"},
		"PATH in env":                      {"readyTimeout: 15s", "readyTimeout: 15s\n  env: {PATH: /tmp}"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			y := strings.Replace(fuseBase, c.from, c.to, 1)
			if y == fuseBase {
				t.Fatalf("replacement %q not found", c.from)
			}
			if _, err := loadFuse(t, y); err == nil {
				t.Fatalf("accepted:\n%s", y)
			}
		})
	}
	if _, err := loadFuse(t, fuseBase+strings.TrimPrefix(fuseBase, "fuseProfiles:\n")); err == nil {
		t.Error("two profiles of the same name accepted")
	}
}

func TestCheckFuseWord(t *testing.T) {
	for _, ok := range []string{"user@host:/srv/data", "remote:bucket/path", "/srv/images/a.sqfs", "22", "a~b%c+d"} {
		if err := CheckFuseWord("source", ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-oProxyCommand=x", "a;b", "a b", "$(id)", "`id`", "a|b", "a,b", "a=b", "a\nb", "/srv/../etc", "host:..", "{x}", strings.Repeat("a", 1025)} {
		err := CheckFuseWord("source", bad)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: got %v, want InvalidArgument", bad, err)
		}
	}
}

func TestFuseOptionCheck(t *testing.T) {
	enum := FuseOption{Name: "cache", Values: []string{"yes", "no"}}
	pat := FuseOption{Name: "port", Pattern: "[0-9]{1,5}"}
	for _, c := range []struct {
		o    FuseOption
		v    string
		want bool
	}{
		{enum, "yes", true}, {enum, "maybe", false}, {enum, "yes,no", false},
		{pat, "2222", true}, {pat, "22a", false}, {pat, "123456", false}, {pat, "-1", false},
	} {
		if err := c.o.Check(c.v); (err == nil) != c.want {
			t.Errorf("%s=%q: err %v, want ok=%t", c.o.Name, c.v, err, c.want)
		}
	}
}
