package policy

import (
	"errors"
	"reflect"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
)

func TestFor(t *testing.T) {
	cfg := &config.Config{FuseProfiles: []fuseprofile.Profile{{Name: "a", Binary: "/usr/bin/sshfs"}, {Name: "c", Binary: "/usr/bin/squashfuse"}}}
	p := For(cfg, []string{"/var/lib/mountplan"})
	if !reflect.DeepEqual(p.Names(), []string{"a", "c"}) || !reflect.DeepEqual(p.Roots, []string{"/var/lib/mountplan"}) {
		t.Errorf("policy %+v", p)
	}
	for name, p := range map[string]*Policy{"nil": nil, "no config": For(nil, nil)} {
		if _, err := p.Command(daemon.Spec{Profile: "a"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("%s: Command = %v, want FailedPrecondition", name, err)
		}
	}
}
