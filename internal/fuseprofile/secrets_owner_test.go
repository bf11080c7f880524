package fuseprofile

import (
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
)

// TestSecretsReadableByRoot (review of b705b24, F3): a profile that takes
// secrets and runs its daemon as root leaves them readable by the plugin,
// root in its container; the mounter warns of each such profile.
func TestSecretsReadableByRoot(t *testing.T) {
	base := func(runAs *daemon.User, secrets ...Secret) Profile {
		return Profile{Name: "p", Binary: "/bin/true", Args: []string{"{mountpoint}"}, Source: SourceRule{Pattern: "x"}, Secrets: secrets, RunAs: runAs}
	}
	key := Secret{Name: "key"}
	tests := []struct {
		name string
		p    Profile
		want bool
	}{
		{"secrets as nobody", base(&daemon.User{UID: 65534, GID: 65534}, key), false},
		{"no secrets as root", base(nil), false},
		{"secrets as root (no runAs)", base(nil, key), true},
		{"secrets as uid 0", base(&daemon.User{UID: 0, GID: 65534}, key), true},
		{"secrets with gid 0", base(&daemon.User{UID: 65534, GID: 0}, key), true},
		{"an optional secret as root", base(nil, Secret{Name: "key", Optional: true}), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := Validate([]Profile{tt.p}); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if got := tt.p.SecretsReadableByRoot(); got != tt.want {
				t.Errorf("SecretsReadableByRoot = %t, want %t", got, tt.want)
			}
		})
	}
}
