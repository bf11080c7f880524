package loop

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/loopdev"
)

// RecoverCopy makes the xfs in image, a copy, clean: a frozen xfs is
// consistent on disk, but its log is left dirty (as is that of an xfs
// whose node crashed), which xfs_repair and xfs_admin refuse until a
// mount replays it. The copy is
// attached and mounted once at scratch, with nouuid (its source, of the
// same UUID, is mounted), and unmounted, which leaves a clean log. Other
// filesystems are left as they are: a frozen ext4 has flushed its journal.
// A crash meanwhile leaves a mount at scratch that ClearScratch removes.
func RecoverCopy(ctx context.Context, image, scratch string) error {
	if !isXFS(image) {
		return nil
	}
	dev, err := loopdev.Attach(ctx, image, loopdev.Options{Autoclear: true, BlockSize: fsBlockSize(image)})
	if err != nil {
		return fmt.Errorf("attach the copy %s to replay its log: %w", image, err)
	}
	defer dev.Close()
	if err := os.MkdirAll(scratch, 0o700); err != nil {
		return err
	}
	defer os.Remove(scratch)
	if err := unix.Mount(dev.Path, scratch, "xfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "nouuid"); err != nil {
		return fmt.Errorf("mount the copy %s at %s to replay its log: %w", image, scratch, err)
	}
	if err := unix.Unmount(scratch, 0); err != nil {
		return fmt.Errorf("unmount the copy %s at %s: %w", image, scratch, err)
	}
	return nil
}

// ClearScratch unmounts and removes what an interrupted RecoverCopy left
// at scratch; nothing there is no error.
func ClearScratch(scratch string) error {
	if err := unix.Unmount(scratch, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", scratch, err)
	}
	if err := os.Remove(scratch); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// RecoverScratch is where the copy of snapshot or volume id (kind
// "snapshots" or "volumes") is mounted while its log is replayed.
func RecoverScratch(stateDir, kind, id string) string {
	return filepath.Join(stateDir, "recover", kind, id)
}
