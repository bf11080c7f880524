// Package model holds the driver's records: what the journal keeps of each
// volume (Volume) and snapshot (Snapshot), and the rule for their IDs
// (ValidID). It has no I/O: internal/journal stores the records, the
// driver writes them, and a volume source sees only the types (Kind,
// Format) of the part it reads.
package model

import (
	"fmt"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Kind says where a volume came from, which decides who owns its image.
type Kind string

const (
	KindProvisioned Kind = "provisioned" // CreateVolume made its image: DeleteVolume removes it
	KindStatic      Kind = "static"      // an admin's image under an allowed root: never removed
	KindEphemeral   Kind = "ephemeral"   // inline volume: image made at publish, removed at unpublish
)

// ValidID accepts IDs that are safe as a file name: 1 to 128 characters of
// [A-Za-z0-9._-], not starting with a dot. Every record's ID (a volume's, a
// snapshot's, a source's shared record's key) follows it.
func ValidID(id string) error {
	if id == "" || len(id) > 128 || strings.HasPrefix(id, ".") ||
		strings.IndexFunc(id, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
		}) >= 0 {
		return fmt.Errorf("volume id %q must be 1-128 characters of [A-Za-z0-9._-] not starting with '.': %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}
