// Package mounter performs mount plans: it attaches each descriptor at the
// consumer's mount point inside the consumer's mount namespace, and removes
// them again in reverse order. One executor performs every plan, whether it
// runs in the plugin (kubelet's NodePublishVolume with no sidecar), in the
// sidecar's `serve` daemon, or in the sidecar's one-shot `mount` command.
package mounter

import (
	"context"

	"github.com/mountplan/mountplan/pkg/plan"
)

// Consumer says where a plan is performed.
type Consumer struct {
	// PID of a process in the target mount namespace; 0 means the caller's
	// own mount namespace.
	PID int
	// MountPoint is an absolute path as the consumer's namespace sees it.
	MountPoint string
	// NSInode, when non-zero, is the inode of the namespace that PID must
	// still be in: a PID that was reused by a process elsewhere fails.
	NSInode uint64
	// NSID, when non-zero, is the kernel's never-reused ID of that namespace
	// (NS_GET_MNTNS_ID): PID must be in that very namespace, and once PID no
	// longer names it, the namespace is entered through any process still
	// in it. 0 means unknown.
	NSID uint64
}

// Interface performs and undoes plans. The in-process Executor and the gRPC
// client of the sidecar's Mounter service both implement it.
type Interface interface {
	// Mount performs mounts in order at c. On failure it unmounts what it
	// had attached and returns an error wrapping an errdefs sentinel.
	Mount(ctx context.Context, mounts []plan.Mount, c Consumer) error
	// Unmount removes mounts in reverse order at c. Mounts that are already
	// gone are not an error; a namespace that no longer exists is not an
	// error either (the kernel dropped its mounts with it).
	Unmount(ctx context.Context, mounts []plan.Mount, c Consumer) error
}
