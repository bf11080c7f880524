package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/fuseprofile"
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
  runAs: {uid: 65534, gid: 65534}
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
	p := fuseprofile.Find(c.FuseProfiles, "sshfs")
	if p == nil || p.ReadyTimeout.Duration != 15*time.Second || len(p.Secrets) != 2 || !p.Secrets[1].Stdin || p.Options[0].Default != "22" {
		t.Fatalf("parsed: %+v", p)
	}
	if fuseprofile.Find(c.FuseProfiles, "nfs") != nil {
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
		if fuseprofile.Find(c.FuseProfiles, n) == nil {
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
		"LD_PRELOAD in env":                {"readyTimeout: 15s", "readyTimeout: 15s\n  env: {LD_PRELOAD: /tmp/x.so}"},
		"LD_LIBRARY_PATH in env":           {"readyTimeout: 15s", "readyTimeout: 15s\n  env: {LD_LIBRARY_PATH: /tmp}"},
		"GLIBC_TUNABLES in env":            {"readyTimeout: 15s", "readyTimeout: 15s\n  env: {GLIBC_TUNABLES: x}"},
		"GCONV_PATH in env":                {"readyTimeout: 15s", "readyTimeout: 15s\n  env: {GCONV_PATH: /tmp}"},
		"other placeholder in group args":  {"readyTimeout: 15s", "readyTimeout: 15s\n  mountGroupArgs: [-o, \"gid={source}\"]"},
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
