package fuseprofile

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
)

// fdProfile is a libfuse 3 daemon in fd mode: the mounter mounts, the
// daemon gets the descriptor.
func fdProfile() *Profile {
	return &Profile{Name: "sq", Binary: "/usr/bin/squashfuse", Args: []string{"-f", "{source}", "{mountpoint}", "{options}"},
		Source: SourceRule{Pattern: `[a-z]+`}, ReadOnlyArgs: []string{"-o", "ro"}, FdMount: true,
		MountOptions: []string{"allow_other", "default_permissions", "max_read=131072", "noexec"}}
}

// fd mode: {mountpoint} becomes /dev/fd/3, the daemon holds no capability
// and runs as the profile's user or FdModeUser, never root; the mount's
// options are the mounter's (nosuid, nodev, the user, the subtype) and the
// profile's; ro follows the volume.
func TestFdMount(t *testing.T) {
	spec := daemon.Spec{Profile: "sq", Params: map[string]string{"profile": "sq", "source": "img"}, ReadOnly: true, Paths: testPaths}
	p := fdProfile()
	if err := Validate([]Profile{*p}); err != nil {
		t.Fatal(err)
	}
	c, err := p.Command(spec, "img")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"-f", "img", FdMountPoint, "-o", "ro"}; !slices.Equal(c.Args, want) {
		t.Errorf("args %q, want %q", c.Args, want)
	}
	if c.RunAs == nil || *c.RunAs != FdModeUser || c.Capabilities == nil || len(c.Capabilities) != 0 {
		t.Errorf("runAs %+v, capabilities %q; want %+v and none", c.RunAs, c.Capabilities, FdModeUser)
	}
	opts := p.FuseMountOptions(true, *c.RunAs)
	want := []string{"nosuid", "nodev", "ro", "rootmode=40000", "user_id=65534", "group_id=65534", "subtype=squashfuse",
		"allow_other", "default_permissions", "max_read=131072", "noexec"}
	if !slices.Equal(opts, want) {
		t.Errorf("mount options %q, want %q", opts, want)
	}
	if opts := p.FuseMountOptions(false, daemon.User{UID: 1000, GID: 2000}); slices.Contains(opts, "ro") || !slices.Contains(opts, "user_id=1000") || !slices.Contains(opts, "group_id=2000") {
		t.Errorf("mount options of a writable volume of user 1000:2000: %q", opts)
	}
	p.RunAs = &daemon.User{UID: 1000, GID: 1000}
	if c, err := p.Command(spec, "img"); err != nil || *c.RunAs != *p.RunAs {
		t.Errorf("with runAs: %+v, %v", c.RunAs, err)
	}
	// Not fd mode: the daemon mounts itself, as today.
	p = fdProfile()
	p.FdMount, p.MountOptions = false, nil
	if c, err := p.Command(spec, "img"); err != nil || c.Args[2] != testPaths.MountPoint || c.RunAs != nil || !slices.Equal(c.Capabilities, []string{"SYS_ADMIN"}) {
		t.Errorf("without fd mode: %+v, %v", c, err)
	}
	if p.SecretsReadableByRoot() {
		t.Error("a profile without secrets has secrets readable by root")
	}
	p = fdProfile()
	p.Secrets = []Secret{{Name: "key", Args: []string{"-o", "IdentityFile={path}"}}}
	if p.SecretsReadableByRoot() {
		t.Error("an fd-mode daemon runs as FdModeUser: its secrets are not root's")
	}
}

func TestFdMountRefused(t *testing.T) {
	for _, tt := range []struct {
		name, want string
		edit       func(*Profile)
	}{
		{"runAs root", "root", func(p *Profile) { p.RunAs = &daemon.User{UID: 0, GID: 1000} }},
		{"runAs group root", "root", func(p *Profile) { p.RunAs = &daemon.User{UID: 1000, GID: 0} }},
		{"capabilities", "no capability", func(p *Profile) { p.Capabilities = []string{"SYS_ADMIN"} }},
		{"mountOptions without fdMount", "fdMount", func(p *Profile) { p.FdMount = false }},
		{"the mounter's option fd", "set by the mounter", func(p *Profile) { p.MountOptions = []string{"fd=7"} }},
		{"the mounter's option user_id", "set by the mounter", func(p *Profile) { p.MountOptions = []string{"user_id=0"} }},
		{"subtype", "set by the mounter", func(p *Profile) { p.MountOptions = []string{"subtype=x"} }},
		{"ro", "read-only", func(p *Profile) { p.MountOptions = []string{"ro"} }},
		{"suid", "not one of", func(p *Profile) { p.MountOptions = []string{"suid"} }},
		{"dev", "not one of", func(p *Profile) { p.MountOptions = []string{"dev"} }},
		{"unknown", "not one of", func(p *Profile) { p.MountOptions = []string{"blksize=4096"} }},
		{"max_read not a number", "max_read", func(p *Profile) { p.MountOptions = []string{"max_read=x"} }},
		{"a separator", "not one of", func(p *Profile) { p.MountOptions = []string{"allow_other,suid"} }},
		{"twice", "twice", func(p *Profile) { p.MountOptions = []string{"allow_other", "allow_other"} }},
		{"a binary whose name is no subtype", "subtype", func(p *Profile) { p.Binary = "/usr/bin/a,b" }},
	} {
		p := fdProfile()
		tt.edit(p)
		err := Validate([]Profile{*p})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Validate = %v; want InvalidArgument saying %q", tt.name, err, tt.want)
		}
	}
}
