// Package source defines how a kind of volume (loop, and later nbd, iscsi,
// fuse) is activated at stage time and turned into a mount plan. Each kind
// lives in its own package and is registered with the driver by its type
// name: a new kind is a new package, not a new case in a switch.
package source

import (
	"context"
	"encoding/json"

	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/plan"
)

// StageRequest is what NodeStageVolume asks of a source.
type StageRequest struct {
	Block    bool
	ReadOnly bool
	// FsType to create when the device holds no filesystem yet.
	FsType string
	// Save persists v (with an intent such as a pending format) before the
	// source performs the side effect the intent names.
	Save func(v *journal.Volume) error
}

// PlanRequest is what a publish or prepare asks for.
type PlanRequest struct {
	Block      bool
	ReadOnly   bool
	MountFlags []string
}

// Source activates and deactivates one kind of volume.
type Source interface {
	// Stage activates v's device and returns the state to keep in the
	// journal. On error it leaves nothing attached.
	Stage(ctx context.Context, v *journal.Volume, req StageRequest) (json.RawMessage, error)
	// Plan returns the mounts that make a staged v appear at a mount point.
	// The plan is concrete: every source and option path is final.
	Plan(v *journal.Volume, req PlanRequest) ([]plan.Mount, error)
	// Unstage deactivates v after checking that what it detaches is still
	// v's (device numbers are reused quickly). Idempotent.
	Unstage(ctx context.Context, v *journal.Volume) error
	// Adopt re-establishes in-memory handles for a staged v after a plugin
	// restart, repairing what it can. It returns the (possibly updated) state.
	Adopt(ctx context.Context, v *journal.Volume) (json.RawMessage, error)
}
