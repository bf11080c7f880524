package fsutil

import (
	"context"
	"fmt"
	"strings"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

func (t tools) format(ctx context.Context, device, fsType string, extra []string) error {
	var tool toolrun.Tool
	var args []string
	switch fsType {
	case Ext4:
		// Lazy init leaves inode tables and the journal to be zeroed after
		// mount (or never, on a sparse image that reads back zeroes), so
		// formatting a large sparse image takes milliseconds, not minutes.
		tool, args = mkfsExt4, []string{"-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1"}
	case XFS:
		tool, args = mkfsXFS, []string{"-f", "-q"}
	default:
		return fmt.Errorf("fsutil: format %s: filesystem type %q not in %v: %w",
			device, fsType, SupportedFsTypes(), errdefs.ErrInvalidArgument)
	}
	if err := checkPath("format", device); err != nil {
		return err
	}
	args = append(append(args, extra...), device)
	_, err := t.run(ctx, device, tool, args...)
	return err
}

func (t tools) resize(ctx context.Context, device, fsType, mountPath string) error {
	switch fsType {
	case Ext4:
		if err := checkPath("resize", device); err != nil {
			return err
		}
		_, err := t.run(ctx, device, resize2fs, device)
		if err != nil && strings.Contains(err.Error(), "Permission denied to resize") {
			// The kernel's online resize ioctl wants CAP_SYS_RESOURCE;
			// say so instead of passing on resize2fs's riddle.
			return fmt.Errorf("fsutil: online resize of ext4 on %s needs CAP_SYS_RESOURCE, which this process lacks: %w",
				device, errdefs.ErrFailedPrecondition)
		}
		return err
	case XFS:
		if mountPath == "" {
			return fmt.Errorf("fsutil: resize %s: xfs grows only while mounted, no mount path given: %w",
				device, errdefs.ErrFailedPrecondition)
		}
		_, err := t.run(ctx, mountPath, xfsGrowfs, mountPath)
		return err
	}
	return fmt.Errorf("fsutil: resize %s: filesystem type %q not in %v: %w",
		device, fsType, SupportedFsTypes(), errdefs.ErrInvalidArgument)
}
