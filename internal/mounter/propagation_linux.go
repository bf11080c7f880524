package mounter

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
)

// propagation is a mount's place in the propagation graph: the peer group it
// shares mount events with, and the peer group it receives them from.
type propagation struct{ shared, master int }

func propagationOf(i *mountinfo.Info) propagation {
	var p propagation
	for _, f := range strings.Fields(i.Optional) {
		tag, val, _ := strings.Cut(f, ":")
		n, _ := strconv.Atoi(val)
		switch tag {
		case "shared":
			p.shared = n
		case "master":
			p.master = n
		}
	}
	return p
}

// guard refuses to attach a volume under a shared mount whose mount events
// reach the mounter's own or the host's namespace: there the volume would
// outlive the consumer, and nobody would unmount it. Peer group IDs are
// global, so the namespaces' tables can be compared.
//
// The outside tables are needed only when the mount a target lies on is
// shared, which a container's private or slave mounts are not: newGuard
// opens them (a mountinfo file shows the namespace of its task as it was
// at open, so the mounter's own table reads the same from inside the
// consumer's namespace) and check reads them only then.
type guard struct {
	tables  []*os.File    // the outside mountinfo files, open, not read yet
	outside []propagation // of the mounts in the mounter's and the host's namespaces, once read
	read    bool
}

// newGuard returns nil when nothing needs checking: propagation is allowed,
// or the consumer lives in the mounter's own or the host's namespace.
// Close the guard when done.
func (e *Executor) newGuard(ns *mountns.Namespace) (_ *guard, err error) {
	if e.AllowPropagation || ns.IsSelf() {
		return nil, nil
	}
	var hostInode uint64
	var st unix.Stat_t
	if unix.Stat("/proc/1/ns/mnt", &st) == nil {
		hostInode = st.Ino
	}
	if hostInode == ns.Inode() {
		return nil, nil
	}
	g := &guard{}
	defer func() {
		if err != nil {
			g.close()
		}
	}()
	tables := []string{"/proc/thread-self/mountinfo"}
	if hostInode != 0 {
		tables = append(tables, "/proc/1/mountinfo")
	}
	for _, t := range tables {
		fd, err := unix.Open(t, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("propagation check: %w", &os.PathError{Op: "open", Path: t, Err: err})
		}
		g.tables = append(g.tables, os.NewFile(uintptr(fd), t))
	}
	return g, nil
}

// close releases the outside tables; nil is a no-op.
func (g *guard) close() {
	if g == nil {
		return
	}
	for _, f := range g.tables {
		f.Close()
	}
	g.tables = nil
}

// readOutside reads the outside tables once.
func (g *guard) readOutside() error {
	if g.read {
		return nil
	}
	for _, f := range g.tables {
		infos, err := mountinfo.GetMountsFromReader(f, nil)
		if err != nil {
			return fmt.Errorf("propagation check: %s: %w", f.Name(), err)
		}
		for _, i := range infos {
			if p := propagationOf(i); p != (propagation{}) {
				g.outside = append(g.outside, p)
			}
		}
	}
	g.read = true
	return nil
}

// check fails if a mount attached at target would propagate outside. Run
// inside the namespace.
func (g *guard) check(ns *mountns.Namespace, target *os.File) error {
	// Most often the mount a target lies on is not shared, which the
	// kernel tells about that one mount (statmount); the table is read
	// only when it is, or when the kernel cannot tell.
	if group, err := sharedGroupOf(target); err == nil && group == 0 {
		return nil
	} else if err != nil && !errors.Is(err, errNoStatmount) {
		return err
	}
	st, err := statxOf(target, unix.STATX_MNT_ID, false)
	if err != nil {
		return err
	}
	infos, err := ns.MountInfo(nil)
	if err != nil {
		return err
	}
	var parent *mountinfo.Info
	for _, i := range infos {
		if uint64(i.ID) == st.Mnt_id {
			parent = i
		}
	}
	if parent == nil {
		return fmt.Errorf("mount %d under %s is not in the mount table", st.Mnt_id, target.Name())
	}
	group := propagationOf(parent).shared
	if group == 0 {
		return nil
	}
	if err := g.readOutside(); err != nil {
		return err
	}
	if !g.reaches(group, infos) {
		return nil
	}
	return fmt.Errorf("%s lies on %s, which shares mount events (peer group %d) with the mounter's or the host's namespace, "+
		"where the volume would outlive the consumer; make that mount private or slave in the consumer: %w",
		target.Name(), parent.Mountpoint, group, errdefs.ErrFailedPrecondition)
}

// reaches reports whether mount events in peer group from arrive in any
// outside mount: through its peers, their slaves, their slaves' peers, ...
func (g *guard) reaches(from int, consumer []*mountinfo.Info) bool {
	all := append([]propagation{}, g.outside...)
	for _, i := range consumer {
		all = append(all, propagationOf(i))
	}
	reached := map[int]bool{from: true}
	for grew := true; grew; {
		grew = false
		for _, p := range all {
			if p.master != 0 && reached[p.master] && p.shared != 0 && !reached[p.shared] {
				reached[p.shared], grew = true, true
			}
		}
	}
	for _, p := range g.outside {
		if reached[p.shared] || reached[p.master] {
			return true
		}
	}
	return false
}
