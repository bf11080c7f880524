package loop

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/source"
)

// The freeze ioctls of linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const (
	ioctlFIFREEZE = 0xC0045877
	ioctlFITHAW   = 0xC0045878
)

// freezable are the filesystems whose freeze makes the image under them
// consistent on disk (journal flushed, no write in flight).
var freezable = []string{"ext4", "xfs", "btrfs"}

// Freeze freezes the filesystem of the staged v, which its consumers may
// be writing, so that its image can be copied as one point in time; thaw
// undoes it. The filesystem is reached through a private mount of the
// volume's device at scratch: a second mount of a mounted ext4 or xfs is
// the same superblock, whichever mount namespaces its consumers see it in.
// A filesystem someone else froze is refused (thawing it after the copy
// would undo their freeze), and so is one that cannot be frozen.
func (s *Source) Freeze(ctx context.Context, v source.Volume, scratch string) (thaw func() error, err error) {
	dev, fsType, err := s.freezeTarget(v)
	if err != nil {
		return nil, err
	}
	dir, err := mountScratch(dev, fsType, scratch)
	if err != nil {
		return nil, err
	}
	if err := unix.IoctlSetInt(int(dir.Fd()), ioctlFIFREEZE, 0); err != nil {
		err = fmt.Errorf("FIFREEZE %s (%s of volume %s): %w", fsType, dev, v.ID, freezeError(err))
		return nil, errors.Join(err, unmountScratch(dir, scratch))
	}
	klog.FromContext(ctx).V(2).Info("Froze the filesystem for a copy", "volume", v.ID, "device", dev)
	return func() error {
		err := unix.IoctlSetInt(int(dir.Fd()), ioctlFITHAW, 0)
		if err != nil {
			err = fmt.Errorf("FITHAW %s of volume %s: %w", dev, v.ID, err)
		}
		return errors.Join(err, unmountScratch(dir, scratch))
	}, nil
}

// Thaw thaws the staged v's filesystem if a copy interrupted by a crash
// left it frozen; a filesystem that is not frozen is left as it is.
func (s *Source) Thaw(ctx context.Context, v source.Volume, scratch string) error {
	dev, fsType, err := s.freezeTarget(v)
	if err != nil {
		return err
	}
	// A scratch mount of the dead process is still here when the plugin
	// runs in the host's mount namespace: take it away first.
	if err := unix.Unmount(scratch, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", scratch, err)
	}
	dir, err := mountScratch(dev, fsType, scratch)
	if err != nil {
		return err
	}
	err = unix.IoctlSetInt(int(dir.Fd()), ioctlFITHAW, 0)
	switch {
	case errors.Is(err, unix.EINVAL): // not frozen
		err = nil
	case err == nil:
		klog.FromContext(ctx).Info("Thawed a filesystem that an interrupted copy left frozen", "volume", v.ID, "device", dev)
	default:
		err = fmt.Errorf("FITHAW %s of volume %s: %w", dev, v.ID, err)
	}
	return errors.Join(err, unmountScratch(dir, scratch))
}

// freezeTarget returns the device and filesystem of a staged v.
func (s *Source) freezeTarget(v source.Volume) (string, string, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return "", "", err
	}
	dev := s.held(v.ID)
	if dev == nil {
		return "", "", fmt.Errorf("volume %s has no attached loop device: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if st.Chain != nil || !slices.Contains(freezable, st.FsType) {
		return "", "", fmt.Errorf("volume %s holds %q, which cannot be frozen for a consistent copy (%s can): %w",
			v.ID, st.FsType, strings.Join(freezable, ", "), errdefs.ErrFailedPrecondition)
	}
	return dev.Path, st.FsType, nil
}

// freezeError explains the errors FIFREEZE gives for reasons of the
// filesystem's: someone froze it already, or it has no freeze.
func freezeError(err error) error {
	switch {
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("%w: it is frozen already by someone else: %w", err, errdefs.ErrFailedPrecondition)
	case errors.Is(err, unix.EOPNOTSUPP):
		return fmt.Errorf("%w: %w", err, errdefs.ErrFailedPrecondition)
	}
	return err
}

// mountScratch mounts dev at scratch (nosuid, nodev, noexec: nothing is
// run from it) and opens the mount's root.
func mountScratch(dev, fsType, scratch string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(scratch), 0o700); err != nil {
		return nil, err
	}
	if err := os.Mkdir(scratch, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, err
	}
	if err := unix.Mount(dev, scratch, fsType, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		_ = os.Remove(scratch)
		return nil, fmt.Errorf("mount %s at %s to freeze it: %w", dev, scratch, err)
	}
	dir, err := os.OpenFile(scratch, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		_ = unix.Unmount(scratch, unix.MNT_DETACH)
		_ = os.Remove(scratch)
		return nil, err
	}
	return dir, nil
}

func unmountScratch(dir *os.File, scratch string) error {
	_ = dir.Close()
	if err := unix.Unmount(scratch, 0); err != nil {
		return fmt.Errorf("unmount %s: %w", scratch, err)
	}
	if err := os.Remove(scratch); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// SnapshotImagePath is where a snapshot's image lives.
func SnapshotImagePath(stateDir, id string) string {
	return filepath.Join(stateDir, "images", "snapshots", id+".img")
}

// SnapshotImages lists the snapshot images under the state dir by ID, and
// the temp files of copies a crash interrupted (see TempImages). Only a
// holder of the snapshot's lock may remove them.
func SnapshotImages(stateDir string) (images map[string]string, temps map[string][]string, err error) {
	dir := filepath.Dir(SnapshotImagePath(stateDir, "x"))
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, err
	}
	images = map[string]string{}
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".img"); ok && e.Type().IsRegular() && !strings.HasPrefix(id, ".") {
			images[id] = filepath.Join(dir, e.Name())
		}
	}
	raw, err := fsutil.AtomicTemps(dir)
	if err != nil {
		return nil, nil, err
	}
	temps = map[string][]string{}
	for name, paths := range raw {
		if id, ok := strings.CutSuffix(name, ".img"); ok {
			temps[id] = append(temps[id], paths...)
		}
	}
	return images, temps, nil
}
