// Package fsutil detects, creates, grows and measures filesystems on block
// devices and image files with the util-linux, e2fsprogs and xfsprogs tools.
//
// Every function works on an image file as well as on a device node, so the
// plugin can format an image before it attaches it. Tool output goes into
// errors (bounded); arguments do not, since extra arguments come from
// configuration and are not this package's to reveal.
//
// It also holds the one way the plugin replaces a file atomically
// (WriteFileAtomic, CreateAtomic): the journal, the sources' state files
// and new images all go through it.
package fsutil

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/toolrun"
)

// Filesystem types Format can create.
const (
	Ext4 = "ext4"
	XFS  = "xfs"
)

// Usage is what NodeGetVolumeStats reports for a mounted filesystem.
type Usage struct {
	TotalBytes, AvailableBytes, UsedBytes int64
	TotalInodes, FreeInodes, UsedInodes   int64
}

// SupportedFsTypes lists the types Format can create.
func SupportedFsTypes() []string { return []string{Ext4, XFS} }

// tools runs the helper binaries. The package functions use host; tests
// give their own runner to script exit codes the real tools rarely show.
type tools struct {
	runner toolrun.Runner
}

var host = tools{}

// Detect returns the filesystem type on device, or "" when it holds no
// filesystem or other signature. See tools.detect for what "nothing" means
// after an interrupted format.
func Detect(ctx context.Context, device string) (fsType string, err error) {
	return host.detect(ctx, device)
}

// Format creates an fsType filesystem on device, overwriting whatever is
// there (-F / -f): the caller decides, with Detect and its journal, that
// formatting is wanted. extraArgs go before the device; an ext4 "-E" among
// them replaces the lazy-init defaults (mke2fs keeps the last -E).
func Format(ctx context.Context, device, fsType string, extraArgs ...string) error {
	return host.format(ctx, device, fsType, extraArgs)
}

// FormatNewFile is Format for a regular file that the caller has just
// created and that nobody else can have open, attached or mounted (an
// image under its temp name, before its rename). mkfs.ext4 is spared its
// check that the target is mounted nowhere: that check reads the whole
// mount table and asks every mounted loop device for its backing file, a
// cost that grows with the node's mounts (0.25 s a format with 10,000
// volumes published) and says nothing about a file nobody else can name.
// Anything but a regular file is refused.
func FormatNewFile(ctx context.Context, path, fsType string) error {
	return host.formatNewFile(ctx, path, fsType)
}

// Resize grows the filesystem to the size of its device. ext4 is grown
// with resize2fs on the device (online when mounted); xfs only grows while
// mounted, through xfs_growfs on mountPath.
func Resize(ctx context.Context, device, fsType, mountPath string) error {
	return host.resize(ctx, device, fsType, mountPath)
}

// GrowOffline grows the ext4 filesystem on device, which must be mounted
// nowhere, to the device's size: e2fsck -f -p first (resize2fs insists on
// a checked filesystem), then resize2fs. xfs cannot grow offline.
func GrowOffline(ctx context.Context, device, fsType string) error {
	return host.growOffline(ctx, device, fsType)
}

// NewUUID gives the filesystem in image, a copy of another that may be
// mounted, a UUID of its own where its type needs one to mount beside
// the original (xfs); the image must be attached nowhere.
func NewUUID(ctx context.Context, image, fsType string) error {
	return host.newUUID(ctx, image, fsType)
}

// checkPath turns a missing or unusable device path into the right
// sentinel before a tool sees it: blkid, for one, exits 2 ("nothing
// found") for a path that does not exist.
func checkPath(op, path string) error {
	if path == "" {
		return fmt.Errorf("fsutil: %s: empty path: %w", op, errdefs.ErrInvalidArgument)
	}
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("fsutil: %s %s: %w: %w", op, path, errdefs.ErrNotFound, err)
	case err != nil:
		return fmt.Errorf("fsutil: %s %s: %w", op, path, err)
	case fi.IsDir():
		return fmt.Errorf("fsutil: %s %s: is a directory: %w", op, path, errdefs.ErrInvalidArgument)
	}
	return nil
}
