package policy

import (
	"reflect"
	"testing"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/fuseprofile"
)

func TestFor(t *testing.T) {
	cfg := &config.Config{FuseProfiles: []fuseprofile.Profile{
		{Name: "a", Binary: "/usr/bin/sshfs"},
		{Name: "b", Binary: "/usr/bin/sshfs", RunAs: &daemon.User{UID: 1000, GID: 1000}},
		{Name: "c", Binary: "/usr/bin/squashfuse"},
	}}
	p := For(cfg, []string{"/var/lib/mountplan"})
	want := []Daemon{{Path: "/usr/bin/sshfs"}, {Path: "/usr/bin/sshfs", RunAs: &daemon.User{UID: 1000, GID: 1000}}, {Path: "/usr/bin/squashfuse"}}
	if !reflect.DeepEqual(p.Allowed, want) {
		t.Errorf("allowed %+v, want %+v", p.Allowed, want)
	}
	if got := p.Binaries(); !reflect.DeepEqual(got, []string{"/usr/bin/sshfs", "/usr/bin/squashfuse"}) {
		t.Errorf("binaries %v", got)
	}
	if p := For(nil, nil); len(p.Allowed) != 0 {
		t.Errorf("no config allows %+v", p.Allowed)
	}
}
