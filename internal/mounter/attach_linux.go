package mounter

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
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
	root       *mountns.Root // where targets are resolved, inside ns
	mountPoint string
	guard      *guard // nil: propagation is not checked

	attached []string // targets this call attached, in order
	created  []string // paths this call created outside its own mounts
}

// build creates every mount of the plan, detached, before any is attached,
// so a plan that cannot be built leaves no trace in the consumer.
func build(mounts []plan.Mount, srcs []*os.File) (_ *attacher, err error) {
	a := &attacher{mounts: mounts}
	defer func() {
		if err != nil {
			a.close()
		}
	}()
	for i, m := range mounts {
		f, err := mountns.BuildFrom(m, srcs[i])
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

// narrow replaces the plan's one built mount with a detached mount of its
// directory sub: a consumer's subPath (mountns.SubTree).
func (a *attacher) narrow(sub string) error {
	if len(a.built) != 1 {
		return fmt.Errorf("subPath %s of a plan of %d mounts: only a plan of one mount has one: %w", sub, len(a.built), errdefs.ErrFailedPrecondition)
	}
	f, err := mountns.SubTree(a.built[0], sub)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return fmt.Errorf("fstat subPath %s: %w", sub, err)
	}
	a.built[0].Close()
	a.built[0] = f
	a.roots[0] = root{dev: uint64(st.Dev), ino: st.Ino, dir: true} //nolint:unconvert // Dev is uint32 on some architectures
	return nil
}

// idmap makes every built mount an idmapped mount of the user namespace
// that owns ns, when that is not the mounter's own: a container of a pod
// with hostUsers: false, whose root is an unprivileged uid of the node.
// Without it that root would see the volume's files owned by nobody and
// could not write them; with it, it sees on-disk root as its own root and
// writes files the next consumer, of any uid range, sees as root's. The
// mounter decides it from the namespace it mounts into, never from the
// plan: no plan option asks for it or can turn it off.
func (a *attacher) idmap(ns *mountns.Namespace) error {
	userns, err := ns.UserNS()
	if err != nil || userns == nil {
		return err
	}
	defer userns.Close()
	for i, f := range a.built {
		if err := mountns.IDMap(f, userns, a.mounts[i].Type); err != nil {
			return fmt.Errorf("mount %d: %w", i, err)
		}
	}
	return nil
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

// attach resolves target below the root (no symlink followed), creating
// what is missing, and attaches built mount i exactly there.
func (a *attacher) attach(i int, target string) error {
	if err := a.ensure(target, !a.roots[i].dir); err != nil {
		return err
	}
	t, err := a.root.Open(target)
	if err != nil {
		return err
	}
	defer t.Close()
	if done, err := a.alreadyMounted(i, t); err != nil || done {
		return err
	}
	if a.guard != nil {
		if err := a.guard.check(a.ns, t); err != nil {
			return err
		}
	}
	if err := mountns.AttachAt(a.built[i], t); err != nil {
		return err
	}
	a.attached = append(a.attached, target)
	// The fd is an open file on the mount's root: it would keep the mount
	// busy, and a rollback could not unmount it.
	a.built[i].Close()
	a.built[i] = nil
	return nil
}

// ensure creates target and its missing parents below the root
// (directories; target itself an empty file when the mount's root is not a
// directory), never through a symlink. Paths created inside this call's own
// mounts are not recorded: they belong to the volume and vanish from view
// when it is unmounted.
func (a *attacher) ensure(target string, file bool) error {
	created, err := a.root.MkdirAll(target, file)
	for _, p := range created {
		if !plan.WithinAny(a.attached, p) {
			a.created = append(a.created, p)
		}
	}
	return err
}

// alreadyMounted reports whether target is the root of a mount of the same
// thing as built mount i: the same directory or file (a bind, or a block
// filesystem whose superblock is shared), or, for filesystems that get a new
// superblock every time (tmpfs, overlay), the same type and source.
func (a *attacher) alreadyMounted(i int, target *os.File) (bool, error) {
	st, err := statxOf(target, unix.STATX_INO|unix.STATX_MNT_ID, false)
	if err != nil {
		return false, err
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
		p, err := resolvedPath(a.ns, a.root, a.attached[i])
		if err == nil && p != "" {
			err = detach(p)
			if errors.Is(err, unix.EBUSY) {
				// Something in the consumer already uses it; a failed Mount
				// must still not leave the volume attached.
				err = mountns.Unmount(p, true)
			}
		}
		errs = append(errs, err)
	}
	for i := len(a.created) - 1; i >= 0; i-- {
		errs = append(errs, a.root.Remove(a.created[i]))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("rollback: %w", err)
	}
	return nil
}
