package plan

import (
	"fmt"
	"slices"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Heal asks the mounter to replace every mount of FUSE connections whose
// daemon died with the volume's new FUSE mount, in place, wherever on the
// node a mount namespace holds one (the Mounter's HealFuse).
type Heal struct {
	// Dead are connection IDs: a FUSE mount's device number as the kernel
	// encodes it (major << 20 | minor).
	Dead []uint64
	// Source is the volume's new FUSE mount, as its plan's bind source
	// names it.
	Source string
}

// maxDead bounds a request: a volume's daemon restarts a few times
// between two heals, never thousands.
const maxDead = 64

// Validate checks the request's form; the mounter checks what it names.
func (h Heal) Validate() error {
	if len(h.Dead) == 0 || len(h.Dead) > maxDead {
		return fmt.Errorf("heal: %d dead connections, want 1 to %d: %w", len(h.Dead), maxDead, errdefs.ErrInvalidArgument)
	}
	if slices.Contains(h.Dead, 0) {
		return fmt.Errorf("heal: connection 0 is no FUSE connection: %w", errdefs.ErrInvalidArgument)
	}
	if !IsCleanAbs(h.Source) {
		return fmt.Errorf("heal: source %q must be a clean absolute path: %w", h.Source, errdefs.ErrInvalidArgument)
	}
	return nil
}

// StaleMount is a mount of a dead connection in one mount namespace.
type StaleMount struct {
	Namespace Namespace
	// PID is a process of the namespace when it was found.
	PID int64
	// MountPoint is where the namespace sees it.
	MountPoint string
	Conn       uint64
	// Reason says why it is left (empty for a healed mount).
	Reason string
}

func (s StaleMount) String() string {
	msg := fmt.Sprintf("connection %d at %s in mount namespace %s (pid %d)", s.Conn, s.MountPoint, s.Namespace, s.PID)
	if s.Reason != "" {
		msg += ": " + s.Reason
	}
	return msg
}

// HealResult is what a heal did and what it could not do.
type HealResult struct {
	Healed []StaleMount
	// Left holds the mounts of the dead connections still in place when
	// the heal ended.
	Left []StaleMount
}
