// Package mounter performs mount plans: its Executor attaches each
// descriptor at the consumer's mount point inside the consumer's mount
// namespace, and removes them again in reverse order. One executor performs
// every plan, whether it runs in the plugin (kubelet's NodePublishVolume
// with no sidecar), in the sidecar's `serve` daemon, or in the sidecar's
// one-shot `mount` command. Interface is what the plugin holds; the Mounter
// gRPC service that serves it (and its client) is pkg/mounter/service.
package mounter

import (
	"context"

	"github.com/mountplan/mountplan/pkg/plan"
)

// Interface performs and undoes plans. The in-process Executor and the gRPC
// client of the sidecar's Mounter service both implement it.
type Interface interface {
	// Mount performs mounts in order at c. On failure it unmounts what it
	// had attached and returns an error wrapping an errdefs sentinel.
	Mount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error
	// Unmount removes mounts in reverse order at c. Mounts that are already
	// gone are not an error; a namespace that no longer exists is not an
	// error either (the kernel dropped its mounts with it).
	Unmount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error
}

// Healer replaces, in place and in every mount namespace of the node, the
// mounts of FUSE connections whose daemon died with the volume's new FUSE
// mount (plan.Heal). The Executor and the Mounter service's client
// implement it.
type Healer interface {
	// HealFuse returns what it replaced and what is left (with the
	// reason); an error means the request itself was refused or the node's
	// mount tables could not be read.
	HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error)
}
