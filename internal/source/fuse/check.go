package fuse

import (
	"fmt"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
)

// maxSecret bounds one secret (the mounter's bound too).
const maxSecret = 64 << 10

func invalid(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

// checkSecrets makes sure the stage request carries every required secret
// of the profile, nothing else, and none too large. Errors name keys, never
// values.
func checkSecrets(p *fuseprofile.Profile, secrets map[string]string) error {
	names := make([]string, 0, len(secrets))
	for k, v := range secrets {
		names = append(names, k)
		if len(v) > maxSecret {
			return invalid("secret %q is larger than %d bytes", k, maxSecret)
		}
	}
	return p.CheckSecretNames(names)
}
