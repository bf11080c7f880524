package mountns

import (
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/pkg/plan"
)

// IsFuse reports whether a mount is a FUSE filesystem (fuse, fuseblk,
// fuse.sshfs, ...).
func IsFuse(i *mountinfo.Info) bool {
	return i.FSType == "fuse" || i.FSType == "fuseblk" || strings.HasPrefix(i.FSType, "fuse.") || strings.HasPrefix(i.FSType, "fuseblk.")
}

// MountsUnder returns the mounts at or below dir in the caller's
// namespace, in the table's order (oldest first).
func MountsUnder(dir string) ([]*mountinfo.Info, error) {
	return mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return !plan.Within(dir, i.Mountpoint), false
	})
}

// FuseAt returns the FUSE mount on top at p in the caller's namespace, or
// nil when the top is not FUSE or nothing is mounted there.
func FuseAt(p string) (*mountinfo.Info, error) {
	stack, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) { return i.Mountpoint != p, false })
	if err != nil {
		return nil, err
	}
	i := Top(stack)
	if i == nil || !IsFuse(i) {
		return nil, nil
	}
	return i, nil
}
