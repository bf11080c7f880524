package mounter

import (
	"bytes"
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
type guard struct {
	outside []propagation // of the mounts in the mounter's and the host's namespaces
}

// newGuard returns nil when nothing needs checking: propagation is allowed,
// or the consumer lives in the mounter's own or the host's namespace.
func (e *Executor) newGuard(ns *mountns.Namespace) (*guard, error) {
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
	tables := []string{"/proc/thread-self/mountinfo"}
	if hostInode != 0 {
		tables = append(tables, "/proc/1/mountinfo")
	}
	for _, t := range tables {
		if err := g.addTable(t); err != nil {
			return nil, err
		}
	}
	return g, nil
}

func (g *guard) addTable(file string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("propagation check: %w", err)
	}
	infos, err := mountinfo.GetMountsFromReader(bytes.NewReader(data), nil)
	if err != nil {
		return fmt.Errorf("propagation check: %s: %w", file, err)
	}
	for _, i := range infos {
		if p := propagationOf(i); p != (propagation{}) {
			g.outside = append(g.outside, p)
		}
	}
	return nil
}

// check fails if a mount attached at target would propagate outside. Run
// inside the namespace.
func (g *guard) check(ns *mountns.Namespace, target *os.File) error {
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
	if group == 0 || !g.reaches(group, infos) {
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
