package fuse

import (
	"fmt"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fuseprofile"
)

func invalid(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

// checkSecrets makes sure the stage request carries every required secret
// of the profile, nothing else, and none too large. Errors name keys, never
// values.
func checkSecrets(p *fuseprofile.Profile, secrets map[string]string) (map[string]bool, error) {
	given := map[string]bool{}
	names := make([]string, 0, len(secrets))
	for k, v := range secrets {
		given[k] = true
		names = append(names, k)
		if len(v) > maxSecret {
			return nil, invalid("secret %q is larger than %d bytes", k, maxSecret)
		}
	}
	if err := p.CheckSecretNames(names); err != nil {
		return nil, err
	}
	return given, nil
}
