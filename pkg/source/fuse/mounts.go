package fuse

import (
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The plugin's own mount table, where the state dir's mounts appear by
// propagation: nothing here stats a path that may be a dead or hung FUSE
// mount.

// isFuse reports whether a mount is a FUSE filesystem (fuse, fuseblk,
// fuse.sshfs, ...).
func isFuse(i *mountinfo.Info) bool {
	return i.FSType == "fuse" || i.FSType == "fuseblk" || strings.HasPrefix(i.FSType, "fuse.") || strings.HasPrefix(i.FSType, "fuseblk.")
}

// connOf is the FUSE connection ID of a mount: the kernel's dev_t of its
// superblock. The kernel encodes a dev_t as major<<20 | minor.
func connOf(i *mountinfo.Info) uint64 {
	return uint64(i.Major)<<20 | uint64(i.Minor)
}

// mountsUnder returns the mounts at or below dir in the plugin's
// namespace, in the table's order (oldest first).
func mountsUnder(dir string) ([]*mountinfo.Info, error) {
	return mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return !plan.Within(dir, i.Mountpoint), false
	})
}

// fuseAt returns the FUSE mount on top at p, or nil when the top is not
// FUSE or nothing is mounted there.
func fuseAt(p string) (*mountinfo.Info, error) {
	stack, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) { return i.Mountpoint != p, false })
	if err != nil {
		return nil, err
	}
	i := mountns.Top(stack)
	if i == nil || !isFuse(i) {
		return nil, nil
	}
	return i, nil
}
