package fuseprofile

import (
	"errors"
	"slices"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
)

func testProfile() *Profile {
	return &Profile{
		Name:   "t",
		Binary: "/bin/t",
		Args:   []string{"-f", "{source}", "{mountpoint}", "--cache={workdir}/c", "-o", "key={secret:key}", "{options}", "--last"},
		Source: SourceRule{Pattern: `[a-z]+@[a-z]+:/[a-z]*`},
		Options: []Option{
			{Name: "port", Pattern: "[0-9]+", Default: "22", Args: []string{"-p", "{value}"}},
			{Name: "mode", Values: []string{"a", "b"}, Args: []string{"--mode={value}"}},
		},
		ReadOnlyArgs: []string{"-o", "ro"},
		Secrets: []Secret{
			{Name: "key"},
			{Name: "pass", Optional: true, Stdin: true, Args: []string{"-o", "password_stdin"}},
			{Name: "ca", Optional: true, Args: []string{"--ca={path}"}},
		},
		Env:   map[string]string{"HOME": "/st"},
		RunAs: &daemon.User{UID: 1000, GID: 1000},
	}
}

var testPaths = daemon.Paths{MountPoint: "/st/fuse/v/mnt", WorkDir: "/st/fuse/v/work", SecretsDir: "/st/fuse/v/secrets", Log: "/st/fuse/v/daemon.log"}

func TestCommand(t *testing.T) {
	p := testProfile()
	spec := daemon.Spec{Profile: "t", Params: map[string]string{"profile": "t", "source": "u@h:/d", "mode": "b"},
		ReadOnly: true, Secrets: []string{"key", "ca"}, Paths: testPaths}
	c, err := p.Command(spec, "u@h:/d")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"-f", "u@h:/d", "/st/fuse/v/mnt", "--cache=/st/fuse/v/work/c", "-o", "key=/st/fuse/v/secrets/key",
		"-p", "22", "--mode=b", "-o", "ro", "--ca=/st/fuse/v/secrets/ca", "--last"}
	if !slices.Equal(c.Args, want) || c.Stdin != "" || c.Path != "/bin/t" || c.Log != testPaths.Log || *c.RunAs != *p.RunAs {
		t.Errorf("command:\n got %+v\nwant args %q", c, want)
	}
	if wantEnv := []string{daemonPATH, "HOME=/st"}; !slices.Equal(c.Env, wantEnv) {
		t.Errorf("env %q, want %q", c.Env, wantEnv)
	}
	if c.Spec == nil || c.Spec.Profile != "t" || !slices.Equal(c.Spec.Secrets, []string{"ca", "key"}) {
		t.Errorf("spec %+v", c.Spec)
	}
	// The command carries its spec: rendering it again gives the same.
	again, err := p.Command(*c.Spec, "u@h:/d")
	if err != nil || !slices.Equal(again.Args, c.Args) {
		t.Errorf("rendered again: %q, %v", again.Args, err)
	}

	// Without {options}, the options come last; the stdin secret is the
	// file itself.
	p.Args = []string{"{source}", "{mountpoint}"}
	spec = daemon.Spec{Profile: "t", Params: map[string]string{"profile": "t", "source": "u@h:/d", "port": "2222"},
		Secrets: []string{"pass", "key"}, Paths: testPaths}
	c, err = p.Command(spec, "u@h:/d")
	if err != nil {
		t.Fatal(err)
	}
	want = []string{"u@h:/d", "/st/fuse/v/mnt", "-p", "2222", "-o", "password_stdin"}
	if !slices.Equal(c.Args, want) || c.Stdin != "/st/fuse/v/secrets/pass" {
		t.Errorf("command:\n got %q (stdin %q)\nwant %q", c.Args, c.Stdin, want)
	}
}

// TestCommandMountGroup: a volume staged for a pod's fsGroup gets the
// profile's mountGroupArgs with the group, after the read-only ones; none
// without a group, or without mountGroupArgs.
func TestCommandMountGroup(t *testing.T) {
	p := testProfile()
	p.MountGroupArgs = []string{"-o", "gid={gid},umask=0002"}
	gid := uint32(2000)
	spec := daemon.Spec{Profile: "t", Params: map[string]string{"profile": "t", "source": "u@h:/d"}, ReadOnly: true,
		MountGroup: &gid, Secrets: []string{"key"}, Paths: testPaths}
	c, err := p.Command(spec, "u@h:/d")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"-f", "u@h:/d", "/st/fuse/v/mnt", "--cache=/st/fuse/v/work/c", "-o", "key=/st/fuse/v/secrets/key",
		"-p", "22", "-o", "ro", "-o", "gid=2000,umask=0002", "--last"}
	if !slices.Equal(c.Args, want) {
		t.Errorf("with a mount group:\n got %q\nwant %q", c.Args, want)
	}
	if again, err := p.Command(*c.Spec, "u@h:/d"); err != nil || !slices.Equal(again.Args, c.Args) {
		t.Errorf("rendered again from its spec: %q, %v", again.Args, err)
	}
	spec.MountGroup = nil
	if c, err := p.Command(spec, "u@h:/d"); err != nil || slices.Contains(c.Args, "gid=2000,umask=0002") {
		t.Errorf("without a mount group: %q, %v", c.Args, err)
	}
	spec.MountGroup, p.MountGroupArgs = &gid, nil
	if c, err := p.Command(spec, "u@h:/d"); err != nil || len(c.Args) != len(want)-2 {
		t.Errorf("a profile without mountGroupArgs: %q, %v", c.Args, err)
	}
}

// TestCommandRefuses: what a compromised plugin could send to the mounter
// in a spec never makes an argument or an environment variable of its own.
func TestCommandRefuses(t *testing.T) {
	good := daemon.Spec{Profile: "t", Params: map[string]string{"profile": "t", "source": "u@h:/d"}, Secrets: []string{"key"}, Paths: testPaths}
	with := func(f func(s *daemon.Spec)) daemon.Spec {
		s := good
		s.Params = map[string]string{"profile": "t", "source": "u@h:/d"}
		s.Secrets = slices.Clone(good.Secrets)
		f(&s)
		return s
	}
	cases := map[string]struct {
		spec   daemon.Spec
		source string
		env    map[string]string
	}{
		"another profile":              {spec: with(func(s *daemon.Spec) { s.Profile = "u" })},
		"params of another profile":    {spec: with(func(s *daemon.Spec) { s.Params["profile"] = "u" })},
		"option the profile lacks":     {spec: with(func(s *daemon.Spec) { s.Params["ssh_command"] = "/tmp/x" })},
		"option smuggling an -o":       {spec: with(func(s *daemon.Spec) { s.Params["port"] = "22,ssh_command=x" })},
		"source not the pattern":       {spec: with(func(s *daemon.Spec) { s.Params["source"] = "/etc" })},
		"source starting with a dash":  {spec: with(func(s *daemon.Spec) { s.Params["source"] = "-oProxyCommand=x" })},
		"no source":                    {spec: with(func(s *daemon.Spec) { delete(s.Params, "source") })},
		"resolved source with a comma": {spec: good, source: "u@h:/d,ssh_command=x"},
		"required secret missing":      {spec: with(func(s *daemon.Spec) { s.Secrets = nil })},
		"secret the profile lacks":     {spec: with(func(s *daemon.Spec) { s.Secrets = append(s.Secrets, "token") })},
		"secrets dir with a comma":     {spec: with(func(s *daemon.Spec) { s.Paths.SecretsDir = "/st/x,ssh_command=/tmp/evil" })},
		"mount point with a dash":      {spec: with(func(s *daemon.Spec) { s.Paths.MountPoint = "-f" })},
		"relative work dir":            {spec: with(func(s *daemon.Spec) { s.Paths.WorkDir = "work" })},
		"unclean log":                  {spec: with(func(s *daemon.Spec) { s.Paths.Log = "/st/../etc/passwd" })},
		"log at /":                     {spec: with(func(s *daemon.Spec) { s.Paths.Log = "/" })},
		"LD_PRELOAD in the profile":    {spec: good, env: map[string]string{"LD_PRELOAD": "/tmp/x.so"}},
		"GCONV_PATH in the profile":    {spec: good, env: map[string]string{"GCONV_PATH": "/tmp"}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			p := testProfile()
			if c.env != nil {
				p.Env = c.env
			}
			src := c.source
			if src == "" {
				src = c.spec.Params["source"]
			}
			cmd, err := p.Command(c.spec, src)
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("got %+v, %v; want InvalidArgument", cmd, err)
			}
		})
	}
}

func TestCheckEnv(t *testing.T) {
	if err := CheckEnv([]string{daemonPATH, "HOME=/root", "RCLONE_CONFIG=/x"}); err != nil {
		t.Errorf("a plain environment: %v", err)
	}
	for _, bad := range [][]string{
		{"LD_PRELOAD=/tmp/x.so"}, {"LD_AUDIT=x"}, {"GLIBC_TUNABLES=x"}, {"MALLOC_TRACE=/x"}, {"NOEQUALS"},
		{"=x"}, {"A B=1"}, {"X=a\x00b"}, {"X=1", "X=2"},
	} {
		if err := CheckEnv(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: got %v, want InvalidArgument", bad, err)
		}
	}
}
