package mounter

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	nriguard "github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
)

// hostID is what the mounter's own namespace knows of a bind's source: the
// device its filesystem lives on. Unknown when the source is gone.
type hostID struct {
	dev   uint64
	known bool
}

// identify stats bind sources before entering the consumer's namespace,
// where they are not reachable.
func identify(mounts []plan.Mount) []hostID {
	ids := make([]hostID, len(mounts))
	for i, m := range mounts {
		var st unix.Stat_t
		if m.Type == plan.TypeBind && unix.Stat(m.Source, &st) == nil {
			ids[i] = hostID{dev: uint64(st.Dev), known: true} //nolint:unconvert // Dev is uint32 on some architectures
		}
	}
	return ids
}

// unmountIfOurs unmounts target if the mount on top of it is m. target is
// resolved below root without following a symlink, and what is unmounted
// is the path that resolution found. Run inside the namespace.
//
// A plan's bind of the NRI guard removes every guard stacked there: a new
// guard is put on top of a dead one where it cannot go beneath it
// (guard.Guard.Rearm).
//
// vouch, when not nil, must also vouch for the mount found (see
// voucher.of): a mount that is m but that the mounter cannot tie to its
// own work is refused with errdefs.ErrPermissionDenied and left in place.
func unmountIfOurs(ns *mountns.Namespace, root *mountns.Root, target string, m plan.Mount, id hostID, vouch func(*os.File) bool) error {
	if m.Type != plan.TypeBind || !nriguard.IsSource(m.Source) {
		_, err := unmountOnceIfOurs(ns, root, target, m, id, vouch)
		return err
	}
	for range maxGuards {
		if ours, err := unmountOnceIfOurs(ns, root, target, m, id, vouch); err != nil || !ours {
			return err
		}
	}
	return fmt.Errorf("more than %d guards stacked at %s: %w", maxGuards, target, errdefs.ErrFailedPrecondition)
}

// maxGuards bounds the guards removed from one target: one per restart of
// the mounter while the target was published.
const maxGuards = 64

func unmountOnceIfOurs(ns *mountns.Namespace, root *mountns.Root, target string, m plan.Mount, id hostID, vouch func(*os.File) bool) (bool, error) {
	t, err := root.Open(target)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	ours, lazy, p, err := isOurs(ns, t, m, id)
	vouched := err == nil && ours && (vouch == nil || vouch(t))
	// The descriptor would keep the mount busy.
	t.Close()
	if err != nil || !ours {
		return false, err
	}
	if !vouched {
		return false, fmt.Errorf("the %s mount at %s is not one the mounter made, nor of a source it set up: "+
			"it unmounts only what it mounted: %w", m.Type, p, errdefs.ErrPermissionDenied)
	}
	return true, mountns.Unmount(p, lazy)
}

// isOurs reports whether the mount on top at t (an open target) is m, and
// whether it must be detached lazily: the bind of a FUSE mount whose daemon
// died and was restarted. Its plan's source is now the new daemon's mount,
// so the device differs, but what sits here is its dead predecessor; it may
// be busy (a shell in it), and must go all the same. p is t's path.
func isOurs(ns *mountns.Namespace, t *os.File, m plan.Mount, id hostID) (ours, lazy bool, p string, err error) {
	if p, err = ns.PathOf(t); err != nil {
		return false, false, "", err
	}
	if ours, sure := quickMatch(t, m); sure {
		return ours, false, p, nil
	}
	info, err := topMountAt(ns, p)
	if err != nil || info == nil {
		return false, false, p, err
	}
	if matches(info, m, id) {
		// A guard holds nothing, and a dead one may be busy.
		return true, info.FSType == nriguard.FSType, p, nil
	}
	return deadFuseBind(info, m, t), true, p, nil
}

// resolvedPath is p resolved below root without following a symlink, as
// the mount table shows it; "" when p does not exist. Run inside the
// namespace.
func resolvedPath(ns *mountns.Namespace, root *mountns.Root, p string) (string, error) {
	f, err := root.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	defer f.Close()
	return ns.PathOf(f)
}

// statxOf stats the open file f itself (AT_EMPTY_PATH); forceSync asks a
// network or FUSE filesystem for fresh attributes.
func statxOf(f *os.File, mask int, forceSync bool) (unix.Statx_t, error) {
	flags := unix.AT_EMPTY_PATH
	if forceSync {
		flags |= unix.AT_STATX_FORCE_SYNC
	}
	var st unix.Statx_t
	err := unix.Statx(int(f.Fd()), "", flags, mask, &st)
	runtime.KeepAlive(f)
	if err != nil {
		return st, &os.PathError{Op: "statx", Path: f.Name(), Err: err}
	}
	return st, nil
}

// deadFuseBind reports whether info, on top at target, is the root of a
// FUSE mount where plan m binds one, and its connection is gone: asked
// for fresh attributes, it answers ENOTCONN (the daemon died, or its
// connection was aborted). A live FUSE mount is never taken for dead.
// Run inside the namespace.
func deadFuseBind(info *mountinfo.Info, m plan.Mount, target *os.File) bool {
	if m.Type != plan.TypeBind || !strings.HasPrefix(info.FSType, "fuse") || strings.TrimSuffix(info.Root, "//deleted") != "/" {
		return false
	}
	// FORCE_SYNC: the answer must come from the connection, not from
	// attributes cached before the daemon died.
	_, err := statxOf(target, unix.STATX_TYPE, true)
	return errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.ECONNABORTED)
}

// matches reports whether a mount is the one m describes. It reads only the
// mount table, so it also works when the mount is broken (a dead FUSE
// daemon). A bind is the plan's only when it is of the filesystem the
// plan's source is on: once the source is gone nothing tells one bind from
// another (a path suffix would take a consumer's own bind of some /data
// for a volume's), so none is taken; a dead FUSE bind is recognised by its
// dead connection instead (deadFuseBind).
//
// The NRI guard is the exception: a bind of any guard is the plan's bind
// of one (nriguard.IsSource), since a new guard re-arms the targets of a dead
// one.
func matches(info *mountinfo.Info, m plan.Mount, id hostID) bool {
	if m.Type != plan.TypeBind {
		return info.FSType == m.Type && info.Source == m.Source
	}
	if info.FSType == nriguard.FSType {
		return nriguard.IsSource(m.Source)
	}
	if !id.known || unix.Mkdev(uint32(info.Major), uint32(info.Minor)) != id.dev {
		return false
	}
	// Root is the bound path inside its filesystem: a suffix of the
	// source, or "/" when the source is a mount's root (a FUSE mount).
	root := strings.TrimSuffix(info.Root, "//deleted")
	return root == "/" || strings.HasSuffix(m.Source, root)
}

// topMountAt returns the mount on top of the stack mounted exactly at p (a
// resolved path, as the mount table shows it), or nil when p is not a
// mount point.
func topMountAt(ns *mountns.Namespace, p string) (*mountinfo.Info, error) {
	stack, err := ns.MountInfo(func(i *mountinfo.Info) (bool, bool) { return i.Mountpoint != p, false })
	if err != nil {
		return nil, err
	}
	return mountns.Top(stack), nil
}

func mountByID(ns *mountns.Namespace, id int) (*mountinfo.Info, error) {
	infos, err := ns.MountInfo(func(i *mountinfo.Info) (bool, bool) { return i.ID != id, i.ID == id })
	if err != nil || len(infos) == 0 {
		return nil, err
	}
	return infos[0], nil
}

// unmountTree unmounts everything at or below p, newest first, until
// nothing is left. Run inside the namespace.
func unmountTree(ns *mountns.Namespace, root *mountns.Root, p string) error {
	canonical, err := resolvedPath(ns, root, p)
	if err != nil || canonical == "" {
		return err
	}
	below := func(i *mountinfo.Info) (bool, bool) { return !plan.Within(canonical, i.Mountpoint), false }
	left := -1
	for {
		infos, err := ns.MountInfo(below)
		if err != nil || len(infos) == 0 {
			return err
		}
		if left != -1 && len(infos) >= left {
			return fmt.Errorf("%d mounts remain under %s, first %s: %w", len(infos), p, infos[0].Mountpoint, mountns.Classify(unix.EBUSY))
		}
		left = len(infos)
		for i := len(infos) - 1; i >= 0; i-- {
			if err := detach(infos[i].Mountpoint); err != nil {
				return err
			}
		}
	}
}

// quickMatch answers from two stat calls, without reading the mount table
// (thousands of lines on a busy node), in the common cases: target is no
// mount point at all, or its root is the very device or file m names. It
// is not sure (and the caller reads the table) for filesystems without a
// backing device, for sources that are gone, and for anything else.
func quickMatch(target *os.File, m plan.Mount) (ours, sure bool) {
	tx, err := statxOf(target, unix.STATX_INO, false)
	if err != nil {
		return false, false
	}
	if tx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && tx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, true
	}
	var src unix.Stat_t
	if unix.Stat(m.Source, &src) != nil {
		return false, false
	}
	targetDev := unix.Mkdev(tx.Dev_major, tx.Dev_minor)
	switch {
	case m.Type == plan.TypeBind:
		return targetDev == uint64(src.Dev) && tx.Ino == src.Ino, targetDev == uint64(src.Dev) && tx.Ino == src.Ino //nolint:unconvert // Dev is uint32 on some architectures
	case src.Mode&unix.S_IFMT == unix.S_IFBLK && targetDev == uint64(src.Rdev): //nolint:unconvert // Rdev is uint32 on some architectures
		return true, true
	}
	return false, false
}
