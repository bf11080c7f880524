package loop

import (
	"context"
)

// RecoverCopy makes the xfs in image, a copy, clean: a frozen xfs is
// consistent on disk, but its log is left dirty (as is that of an xfs
// whose node crashed), which xfs_repair and xfs_admin refuse until a
// mount replays it: the mounter mounts the copy once privately. Other
// filesystems are left as they are: a frozen ext4 has flushed its journal.
func (s *Source) RecoverCopy(ctx context.Context, image string) error {
	if !isXFS(image) {
		return nil
	}
	return s.Devices.ReplayLog(ctx, image, fsBlockSize(image))
}
