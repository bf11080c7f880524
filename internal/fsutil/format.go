package fsutil

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/toolrun"
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

func (t tools) formatNewFile(ctx context.Context, path, fsType string) error {
	if fsType != Ext4 {
		return t.format(ctx, path, fsType, nil)
	}
	if err := checkPath("format", path); err != nil {
		return err
	}
	// Lstat: a symlink, whoever made it, is not a file of the caller's.
	if fi, err := os.Lstat(path); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("fsutil: format %s as a new file: not a regular file: %w", path, errdefs.ErrInvalidArgument)
	}
	_, err := t.run(ctx, path, mkfsExt4New, "-F", "-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1", path)
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

// e2fsck -p exit statuses that leave a usable filesystem: 1, errors were
// corrected (a copy taken of a frozen ext4 has none, but an orphan list
// may be cleaned).
const e2fsckCorrected = 1

func (t tools) growOffline(ctx context.Context, device, fsType string) error {
	if fsType != Ext4 {
		return fmt.Errorf("fsutil: grow %s offline: %s grows only mounted: %w", device, fsType, errdefs.ErrFailedPrecondition)
	}
	if err := checkPath("resize", device); err != nil {
		return err
	}
	if _, err := t.run(ctx, device, e2fsck, "-f", "-p", device); err != nil && exitCode(err) != e2fsckCorrected {
		return err
	}
	_, err := t.run(ctx, device, resize2fs, device)
	return err
}

// newUUID gives the xfs in image a UUID of its own: xfs refuses to mount
// a filesystem whose UUID a mounted one has, which a copy of a volume
// beside its source would. ext4 mounts duplicates, and its UUID stays.
func (t tools) newUUID(ctx context.Context, image, fsType string) error {
	if fsType != XFS {
		return nil
	}
	if err := checkPath("new uuid", image); err != nil {
		return err
	}
	_, err := t.run(ctx, image, xfsAdmin, "-U", "generate", image)
	return err
}
