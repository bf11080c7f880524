package fuse

import (
	"github.com/moby/sys/mountinfo"
)

// The plugin's own mount table, where the state dir's mounts appear by
// propagation: nothing here stats a path that may be a dead or hung FUSE
// mount.

// connOf is the FUSE connection ID of a mount: the kernel's dev_t of its
// superblock. The kernel encodes a dev_t as major<<20 | minor.
func connOf(i *mountinfo.Info) uint64 {
	return uint64(i.Major)<<20 | uint64(i.Minor)
}
