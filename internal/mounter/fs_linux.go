package mounter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// openDev opens a device the mounter set up, named by number: its node
// must be the device the caller names, and one the records hold. The
// descriptor pins it while a tool works on it.
func (n *Local) openDev(d Device) (*os.File, error) {
	if !plan.IsCleanAbs(d.Path) || !strings.HasPrefix(d.Path, "/dev/") {
		return nil, fmt.Errorf("device %q must be a node under /dev: %w", d.Path, errdefs.ErrInvalidArgument)
	}
	f, err := n.openDevice(d.Path)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || unix.Major(uint64(st.Rdev)) != d.Major || unix.Minor(uint64(st.Rdev)) != d.Minor { //nolint:unconvert // Rdev is uint32 on some architectures
		f.Close()
		return nil, fmt.Errorf("%s is not device %d:%d: %w", d.Path, d.Major, d.Minor, errdefs.ErrPermissionDenied)
	}
	return f, nil
}

// Detect returns the filesystem on a device the mounter set up.
func (n *Local) Detect(ctx context.Context, d Device) (string, error) {
	f, err := n.openDev(d)
	if err != nil {
		return "", err
	}
	defer f.Close()
	return fsutil.Detect(ctx, d.Path)
}

// Format makes a filesystem on a device the mounter set up.
func (n *Local) Format(ctx context.Context, d Device, fsType string) error {
	f, err := n.openDev(d)
	if err != nil {
		return err
	}
	defer f.Close()
	return fsutil.Format(ctx, d.Path, fsType)
}

// GrowFS grows a device's filesystem to the device's size: ext4 of a
// device mounted nowhere offline (e2fsck, resize2fs: no CAP_SYS_RESOURCE
// needed), anything else online through a private mount (a second mount of
// a mounted ext4 or xfs is the same superblock, wherever its consumers see
// it; xfs grows only mounted).
func (n *Local) GrowFS(ctx context.Context, d Device, fsType string, unused bool) error {
	f, err := n.openDev(d)
	if err != nil {
		return err
	}
	defer f.Close()
	if unused && fsType == fsutil.Ext4 && notMounted(d.Path) {
		return fsutil.GrowOffline(ctx, d.Path, fsType)
	}
	return n.withScratchMount(d, f, fsType, "", func(dir string) error {
		return fsutil.Resize(ctx, d.Path, fsType, dir)
	})
}

// statTypes are the filesystems StatDevice mounts: those a device of a
// volume holds.
var statTypes = []string{fsutil.Ext4, fsutil.XFS, "btrfs", "erofs", "squashfs"}

// StatDevice measures a device's filesystem through a private mount. The
// type is what the device holds, never what the caller says.
func (n *Local) StatDevice(ctx context.Context, d Device, readOnly bool) (u fsutil.Usage, err error) {
	f, err := n.openDev(d)
	if err != nil {
		return u, err
	}
	defer f.Close()
	fsType, err := fsutil.Detect(ctx, d.Path)
	if err != nil {
		return u, err
	}
	if !slices.Contains(statTypes, fsType) {
		return u, fmt.Errorf("%s holds %q, not a filesystem the mounter measures (%s): %w", d.Path, fsType, strings.Join(statTypes, ", "), errdefs.ErrFailedPrecondition)
	}
	data := ""
	if readOnly {
		data = "ro"
	}
	err = n.withScratchMount(d, f, fsType, data, func(dir string) error {
		u, err = fsutil.Stats(dir)
		return err
	})
	return u, err
}

// notMounted reports whether nothing holds the block device at p open
// exclusively: a mounted filesystem does, in any mount namespace.
func notMounted(p string) bool {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// withScratchMount mounts d (open as f) at a fresh private directory
// under the records dir, which only the mounter reaches, runs fn with it,
// and unmounts it (synchronously: a filesystem is clean once fn's caller
// goes on). Tools that need a mount point (xfs_growfs) get one in the
// mounter's namespace.
func (n *Local) withScratchMount(d Device, f *os.File, fsType, data string, fn func(dir string) error) (err error) {
	dir, err := n.scratchDir()
	if err != nil {
		return err
	}
	defer func() {
		if rerr := os.Remove(dir); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) && err == nil {
			err = rerr
		}
	}()
	m := plan.Mount{Type: fsType, Source: d.Path, Options: []string{"nosuid", "nodev", "noexec"}}
	if data != "" {
		m.Options = append(m.Options, data)
	}
	mnt, err := mountns.BuildFrom(m, f)
	if err != nil {
		return err
	}
	err = mountns.Attach(mnt, dir)
	mnt.Close()
	if err != nil {
		return err
	}
	defer func() {
		if uerr := mountns.Unmount(dir, false); uerr != nil {
			err = errors.Join(err, uerr)
		}
	}()
	return fn(dir)
}

// clearScratch removes what an earlier mounter, killed while a tool worked
// on a private mount (a grow, a log replay), left under the scratch
// directory: the mounts, lazily (a tool it ran may still hold one), then
// the directories.
func (n *Local) clearScratch(ctx context.Context) error {
	parent := filepath.Join(n.opts.RecordsDir, "scratch")
	ents, err := os.ReadDir(parent)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(parent, e.Name())
		for range 16 { // a stack of mounts at one place is short
			if ok, err := mountns.IsMountPoint(dir); err != nil || !ok {
				break
			}
			if err := mountns.Unmount(dir, true); err != nil {
				errs = append(errs, err)
				break
			}
		}
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		klog.FromContext(ctx).Info("Removed a private mount an earlier mounter left", "dir", dir)
	}
	return errors.Join(errs...)
}

func (n *Local) scratchDir() (string, error) {
	parent := filepath.Join(n.opts.RecordsDir, "scratch")
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return "", err
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	dir := filepath.Join(parent, hex.EncodeToString(b[:]))
	return dir, os.Mkdir(dir, 0o700)
}

// The freeze ioctls of linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const (
	ioctlFIFREEZE = 0xC0045877
	ioctlFITHAW   = 0xC0045878
)

// freezable are the filesystems whose freeze makes the image under them
// consistent on disk (journal flushed, no write in flight).
var freezable = []string{"ext4", "xfs", "btrfs"}

// frozen holds, by device, the root of the private mount through which a
// filesystem was frozen, until Thaw.
var frozen = struct {
	sync.Mutex
	m map[uint64]*os.File
}{m: map[uint64]*os.File{}}

// Freeze freezes a device's filesystem through a private, detached mount
// of it: the same superblock as its consumers' mounts, in no mount table.
// A filesystem someone else froze is refused (thawing it after the copy
// would undo their freeze), and so is one that cannot be frozen.
func (n *Local) Freeze(ctx context.Context, d Device, fsType string) error {
	if !slices.Contains(freezable, fsType) {
		return fmt.Errorf("%s holds %q, which cannot be frozen for a consistent copy (%s can): %w", d.Path, fsType, strings.Join(freezable, ", "), errdefs.ErrFailedPrecondition)
	}
	root, err := n.privateRoot(d, fsType)
	if err != nil {
		return err
	}
	if err := unix.IoctlSetInt(int(root.Fd()), ioctlFIFREEZE, 0); err != nil {
		root.Close()
		return fmt.Errorf("FIFREEZE %s (%s): %w", d.Path, fsType, freezeError(err))
	}
	frozen.Lock()
	defer frozen.Unlock()
	k := unix.Mkdev(d.Major, d.Minor)
	if old := frozen.m[k]; old != nil {
		old.Close()
	}
	frozen.m[k] = root
	klog.FromContext(ctx).V(2).Info("Froze a filesystem for a copy", "device", d.Path)
	return nil
}

// Thaw thaws a device's filesystem, through the mount Freeze kept or,
// after a restart, a new private one; one that is not frozen is left as
// it is.
func (n *Local) Thaw(ctx context.Context, d Device, fsType string) error {
	k := unix.Mkdev(d.Major, d.Minor)
	frozen.Lock()
	root := frozen.m[k]
	delete(frozen.m, k)
	frozen.Unlock()
	if root == nil {
		var err error
		if root, err = n.privateRoot(d, fsType); err != nil {
			return err
		}
	}
	defer root.Close()
	err := unix.IoctlSetInt(int(root.Fd()), ioctlFITHAW, 0)
	switch {
	case errors.Is(err, unix.EINVAL): // not frozen
		return nil
	case err != nil:
		return fmt.Errorf("FITHAW %s: %w", d.Path, err)
	}
	klog.FromContext(ctx).V(2).Info("Thawed a filesystem", "device", d.Path)
	return nil
}

// privateRoot opens, read-only, the root directory of a detached mount of
// the device's filesystem; the descriptor keeps the mount alive.
func (n *Local) privateRoot(d Device, fsType string) (*os.File, error) {
	f, err := n.openDev(d)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mnt, err := mountns.BuildFrom(plan.Mount{Type: fsType, Source: d.Path, Options: []string{"nosuid", "nodev", "noexec"}}, f)
	if err != nil {
		return nil, err
	}
	defer mnt.Close()
	fd, err := unix.Openat(int(mnt.Fd()), ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: d.Path + " (private mount)", Err: err}
	}
	return os.NewFile(uintptr(fd), d.Path), nil
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

// ReplayLog makes the xfs in image, a copy of a frozen filesystem, clean:
// a frozen xfs is consistent on disk but its log is left dirty, which
// xfs_repair and xfs_admin refuse until a mount replays it. The copy is
// attached (not recorded: it is detached again here) and mounted once
// privately with nouuid (its source, of the same UUID, may be mounted).
func (n *Local) ReplayLog(ctx context.Context, image string, blockSize uint32) error {
	dev, err := n.attach(ctx, image, loopdev.Options{Autoclear: true, BlockSize: blockSize})
	if err != nil {
		return fmt.Errorf("attach the copy %s to replay its log: %w", image, err)
	}
	defer dev.Close()
	f, err := os.Open(dev.Path)
	if err != nil {
		return err
	}
	defer f.Close()
	d := Device{Path: dev.Path, Major: dev.Identity.Major, Minor: dev.Identity.Minor}
	return n.withScratchMount(d, f, "xfs", "nouuid", func(string) error { return nil })
}

// ApplyGroup gives the filesystem of a one-mount plan to group gid, as
// kubelet does with an fsGroup: the root and everything below belong to
// the group, readable and writable by it, directories setgid. It works on
// a private, detached mount of the plan, checked as any plan is.
func (n *Local) ApplyGroup(ctx context.Context, mounts []plan.Mount, gid uint32) error {
	if len(mounts) != 1 || mounts[0].Target != "" {
		return fmt.Errorf("a mount group applies to a plan of one mount at its root, not %d: %w", len(mounts), errdefs.ErrInvalidArgument)
	}
	if err := n.exec.Policy.Validate(mounts); err != nil {
		return err
	}
	srcs, err := n.exec.openSources(mounts)
	defer closeAll(srcs)
	if err != nil {
		return err
	}
	m := mounts[0]
	m.Options = slices.DeleteFunc(slices.Clone(m.Options), func(o string) bool { return o == "ro" })
	mnt, err := mountns.BuildFrom(m, srcs[0])
	if err != nil {
		return err
	}
	defer mnt.Close()
	if err := fsutil.ApplyGroup(fmt.Sprintf("/proc/self/fd/%d", mnt.Fd()), gid); err != nil {
		return fmt.Errorf("giving %s to group %d: %w", m.Source, gid, err)
	}
	klog.FromContext(ctx).V(2).Info("Applied the mount group", "source", m.Source, "gid", gid)
	return nil
}
