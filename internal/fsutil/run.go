package fsutil

import (
	"context"
	"fmt"

	"github.com/mountplan/mountplan/internal/toolrun"
)

// The programs this package runs, with the Debian packages that ship them.
var (
	blkid    = toolrun.Tool{Name: "blkid", Package: "util-linux"}
	mkfsExt4 = toolrun.Tool{Name: "mkfs.ext4", Package: "e2fsprogs"}
	// mkfsExt4New formats a file no one else can have mounted (see
	// FormatNewFile): e2fsprogs reads EXT2FS_PRETEND_RW_MOUNT before
	// looking at any mount table and takes the target for mounted, which a
	// second -F then overrides.
	mkfsExt4New = toolrun.Tool{Name: "mkfs.ext4", Package: "e2fsprogs", Env: []string{"EXT2FS_PRETEND_RW_MOUNT=1"}}
	resize2fs   = toolrun.Tool{Name: "resize2fs", Package: "e2fsprogs"}
	e2fsck      = toolrun.Tool{Name: "e2fsck", Package: "e2fsprogs"}
	mkfsXFS     = toolrun.Tool{Name: "mkfs.xfs", Package: "xfsprogs"}
	xfsGrowfs   = toolrun.Tool{Name: "xfs_growfs", Package: "xfsprogs"}
	xfsAdmin    = toolrun.Tool{Name: "xfs_admin", Package: "xfsprogs"}
)

// run runs tool with args on device and returns its combined output. A
// failure names the device and is a *toolrun.Error (exitCode reads its
// status); a missing binary wraps ErrFailedPrecondition.
func (t tools) run(ctx context.Context, device string, tool toolrun.Tool, args ...string) (string, error) {
	out, err := t.runner.Run(ctx, tool, args)
	if err != nil {
		return out, fmt.Errorf("fsutil: %s: %w", device, err)
	}
	return out, nil
}

// exitCode returns the exit status of a tool that ran and failed, or -1.
func exitCode(err error) int { return toolrun.Status(err) }
