package fuseprofile

import (
	"errors"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestSecretsNeedRunAs (issue 33, F3): a profile that takes secrets runs
// its daemon as a user other than root, who alone reads them; the plugin,
// root in its container, would otherwise read them where it reaches them.
func TestSecretsNeedRunAs(t *testing.T) {
	base := func(runAs *daemon.User, secrets ...Secret) Profile {
		return Profile{Name: "p", Binary: "/bin/true", Args: []string{"{mountpoint}"}, Source: SourceRule{Pattern: "x"}, Secrets: secrets, RunAs: runAs}
	}
	key := Secret{Name: "key"}
	tests := []struct {
		name string
		p    Profile
		ok   bool
	}{
		{"secrets as nobody", base(&daemon.User{UID: 65534, GID: 65534}, key), true},
		{"no secrets as root", base(nil), true},
		{"secrets as root (no runAs)", base(nil, key), false},
		{"secrets as uid 0", base(&daemon.User{UID: 0, GID: 65534}, key), false},
		{"secrets with gid 0", base(&daemon.User{UID: 65534, GID: 0}, key), false},
		{"an optional secret as root", base(nil, Secret{Name: "key", Optional: true}), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate([]Profile{tt.p})
			if tt.ok && err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if !tt.ok && (!errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "runAs")) {
				t.Fatalf("Validate = %v, want InvalidArgument naming runAs", err)
			}
		})
	}
}
