package mounter

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// root identifies the root of a built mount: the directory of a new
// filesystem, or the file, device node or directory a bind clones.
type root struct {
	dev, ino uint64
	dir      bool
}

// attacher performs one Mount call's plan inside the consumer's namespace.
type attacher struct {
	mounts []plan.Mount
	built  []*os.File // detached mounts, built in the mounter's namespace
	roots  []root

	ns         *mountns.Namespace
	mountPoint string
	guard      *guard // nil: propagation is not checked

	attached []string // targets this call attached, in order
	created  []string // paths this call created outside its own mounts
}

// build creates every mount of the plan, detached, before any is attached,
// so a plan that cannot be built leaves no trace in the consumer.
func build(mounts []plan.Mount) (_ *attacher, err error) {
	a := &attacher{mounts: mounts}
	defer func() {
		if err != nil {
			a.close()
		}
	}()
	for i, m := range mounts {
		f, err := mountns.Build(m)
		if err != nil {
			return nil, fmt.Errorf("mount %d: %w", i, err)
		}
		a.built = append(a.built, f)
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return nil, fmt.Errorf("mount %d: fstat %s: %w", i, m.Source, err)
		}
		a.roots = append(a.roots, root{dev: uint64(st.Dev), ino: st.Ino, dir: st.Mode&unix.S_IFMT == unix.S_IFDIR}) //nolint:unconvert // Dev is uint32 on some architectures
	}
	return a, nil
}

// close drops the detached mounts; attached ones stay where they are.
func (a *attacher) close() {
	for _, f := range a.built {
		if f != nil {
			f.Close()
		}
	}
}

// attachAll runs inside the namespace.
func (a *attacher) attachAll() (err error) {
	defer func() {
		if err != nil {
			err = errors.Join(err, a.rollback())
		}
	}()
	for i := range a.mounts {
		target := targetPath(a.mountPoint, a.mounts[i].Target)
		if err := a.attach(i, target); err != nil {
			return fmt.Errorf("mount %d (%s %s) at %s: %w", i, a.mounts[i].Type, a.mounts[i].Source, target, err)
		}
	}
	return nil
}

func (a *attacher) attach(i int, target string) error {
	if err := a.ensure(target, !a.roots[i].dir); err != nil {
		return err
	}
	if done, err := a.alreadyMounted(i, target); err != nil || done {
		return err
	}
	if a.guard != nil {
		if err := a.guard.check(a.ns, target); err != nil {
			return err
		}
	}
	if err := mountns.Attach(a.built[i], target); err != nil {
		return err
	}
	a.attached = append(a.attached, target)
	// The fd is an open file on the mount's root: it would keep the mount
	// busy, and a rollback could not unmount it.
	a.built[i].Close()
	a.built[i] = nil
	return nil
}

// ensure creates target and its missing parents (directories; target itself
// an empty file when the mount's root is not a directory). Paths created
// inside this call's own mounts are not recorded: they belong to the volume
// and vanish from view when it is unmounted.
func (a *attacher) ensure(target string, file bool) error {
	var missing []string
	for p := target; ; p = filepath.Dir(p) {
		_, err := os.Lstat(p)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || p == "/" {
			return mountns.Classify(err)
		}
		missing = append(missing, p)
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := create(missing[i], file && i == 0); err != nil {
			return mountns.Classify(err)
		}
		if !plan.WithinAny(a.attached, missing[i]) {
			a.created = append(a.created, missing[i])
		}
	}
	return nil
}

func create(p string, file bool) error {
	if !file {
		return os.Mkdir(p, 0o750)
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o640)
	if err != nil {
		return err
	}
	return f.Close()
}

// alreadyMounted reports whether target is the root of a mount of the same
// thing as built mount i: the same directory or file (a bind, or a block
// filesystem whose superblock is shared), or, for filesystems that get a new
// superblock every time (tmpfs, overlay), the same type and source.
func (a *attacher) alreadyMounted(i int, target string) (bool, error) {
	var st unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, target, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_INO|unix.STATX_MNT_ID, &st)
	if err != nil {
		return false, &os.PathError{Op: "statx", Path: target, Err: err}
	}
	if st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, nil
	}
	r := a.roots[i]
	if unix.Mkdev(st.Dev_major, st.Dev_minor) == r.dev && st.Ino == r.ino {
		return true, nil
	}
	m := a.mounts[i]
	if m.Type == plan.TypeBind {
		return false, nil
	}
	info, err := mountByID(a.ns, int(st.Mnt_id))
	if err != nil || info == nil {
		return false, err
	}
	return info.FSType == m.Type && info.Source == m.Source, nil
}

// rollback unmounts what this call attached and removes what it created,
// newest first.
func (a *attacher) rollback() error {
	var errs []error
	for i := len(a.attached) - 1; i >= 0; i-- {
		err := detach(a.attached[i])
		if errors.Is(err, unix.EBUSY) {
			// Something in the consumer already uses it; a failed Mount
			// must still not leave the volume attached.
			err = unix.Unmount(a.attached[i], unix.UMOUNT_NOFOLLOW|unix.MNT_DETACH)
		}
		errs = append(errs, err)
	}
	for i := len(a.created) - 1; i >= 0; i-- {
		if err := os.Remove(a.created[i]); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("rollback: %w", err)
	}
	return nil
}
