package plan

import (
	"fmt"
	"slices"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/errdefs"
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

// HealToProto converts a heal request to its wire form.
func HealToProto(h Heal) *api.HealFuseRequest {
	return &api.HealFuseRequest{DeadConnections: slices.Clone(h.Dead), Source: h.Source}
}

// HealFromProto converts a heal request from its wire form and validates it.
func HealFromProto(r *api.HealFuseRequest) (Heal, error) {
	h := Heal{Dead: slices.Clone(r.GetDeadConnections()), Source: r.GetSource()}
	return h, h.Validate()
}

// HealResultToProto converts a heal's result to its wire form.
func HealResultToProto(r HealResult) *api.HealFuseResponse {
	return &api.HealFuseResponse{Healed: staleToProto(r.Healed), Left: staleToProto(r.Left)}
}

// HealResultFromProto converts a heal's result from its wire form.
func HealResultFromProto(r *api.HealFuseResponse) HealResult {
	return HealResult{Healed: staleFromProto(r.GetHealed()), Left: staleFromProto(r.GetLeft())}
}

func staleToProto(in []StaleMount) []*api.StaleMount {
	out := make([]*api.StaleMount, 0, len(in))
	for _, s := range in {
		out = append(out, &api.StaleMount{MntNsInode: s.Namespace.Inode, MntNsId: s.Namespace.ID, Pid: s.PID,
			MountPoint: s.MountPoint, Connection: s.Conn, Reason: s.Reason})
	}
	return out
}

func staleFromProto(in []*api.StaleMount) []StaleMount {
	out := make([]StaleMount, 0, len(in))
	for _, s := range in {
		if s == nil {
			continue
		}
		out = append(out, StaleMount{Namespace: Namespace{Inode: s.GetMntNsInode(), ID: s.GetMntNsId()}, PID: s.GetPid(),
			MountPoint: s.GetMountPoint(), Conn: s.GetConnection(), Reason: s.GetReason()})
	}
	return out
}
