package fuseprofile

import (
	"errors"
	"slices"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
)

// A profile's capabilities: SYS_ADMIN when it names none, its own list
// (canonical) otherwise, none for an empty list; an unknown name is
// refused when the config is loaded.
func TestCapabilities(t *testing.T) {
	spec := daemon.Spec{Profile: "t", Params: map[string]string{"profile": "t", "source": "u@h:/d"}, Secrets: []string{"key"}, Paths: testPaths}
	for _, tt := range []struct {
		name string
		caps []string
		want []string
	}{
		{"absent", nil, []string{"SYS_ADMIN"}},
		{"empty", []string{}, []string{}},
		{"named", []string{"cap_sys_admin", "DAC_READ_SEARCH"}, []string{"DAC_READ_SEARCH", "SYS_ADMIN"}},
	} {
		p := testProfile()
		p.Capabilities = tt.caps
		if err := Validate([]Profile{*p}); err != nil {
			t.Errorf("%s: Validate = %v", tt.name, err)
		}
		c, err := p.Command(spec, "u@h:/d")
		if err != nil || !slices.Equal(c.Capabilities, tt.want) {
			t.Errorf("%s: capabilities %q, %v; want %q", tt.name, c.Capabilities, err, tt.want)
		}
	}
	p := testProfile()
	p.Capabilities = []string{"SYS_ADMIN", "ALL"}
	if err := Validate([]Profile{*p}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Validate with an unknown capability = %v, want InvalidArgument", err)
	}
}
