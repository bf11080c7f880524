package mounter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Why a FUSE daemon's restart needs this: a container that got the volume
// holds a mount of its own of the daemon's connection (a runtime's bind of
// kubelet's target, the mounter's move_mount of a NodePrepare, the runtime's
// mount of an NRI plan). Propagation never replaces such a copy, so when
// the daemon dies every copy answers ENOTCONN until someone replaces it in
// the container's namespace. HealFuse finds them all by device number in
// /proc/*/mountinfo (the mounter has the host's PID namespace) and replaces
// each in place.

// deadProbeTimeout bounds the probe that tells a dead connection (ENOTCONN
// at once) from one that still has a daemon, which may hang.
const deadProbeTimeout = 2 * time.Second

var _ Healer = (*Executor)(nil)

// HealFuse replaces every mount of h.Dead's connections with a clone of
// h.Source (same mount point, same root inside the file system, same
// per-mount flags), in every mount namespace that holds one. It refuses a
// source that is not the root of a FUSE mount at
// <allowed-root>/fuse/<volume>/mnt, never replaces a mount whose connection
// still answers, and in the mounter's own and the host's namespace touches
// only mounts below the kubelet dir. What it could not replace is listed
// in the result's Left, with the reason; Left is read from the mount
// tables again after the pass, so it is what is still there.
func (e *Executor) HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error) {
	var res plan.HealResult
	if err := checkNotCanceled(ctx); err != nil {
		return res, err
	}
	if err := h.Validate(); err != nil {
		return res, err
	}
	src, err := e.openHealSource(h.Source)
	if err != nil {
		return res, err
	}
	defer src.f.Close()
	dead := map[uint64]bool{}
	for _, c := range h.Dead {
		if c == src.conn {
			return res, fmt.Errorf("heal: connection %d is the source's own, not a dead one: %w", c, errdefs.ErrInvalidArgument)
		}
		dead[c] = true
	}
	found, err := findStale(dead)
	if err != nil {
		return res, err
	}
	hl := &healer{e: e, src: src, verdicts: map[uint64]error{}, reasons: map[staleKey]string{}}
	for _, n := range found {
		if ctx.Err() != nil {
			break
		}
		res.Healed = append(res.Healed, hl.healNamespace(ctx, n)...)
	}
	if res.Left, err = hl.left(dead); err != nil {
		return res, err
	}
	klog.FromContext(ctx).V(2).Info("Healed mounts of dead FUSE connections", "source", h.Source, "dead", h.Dead,
		"healed", len(res.Healed), "left", len(res.Left))
	return res, nil
}

// healSource is the volume's new FUSE mount, open in the mounter's own
// namespace.
type healSource struct {
	f      *os.File // O_PATH, the mount's root
	conn   uint64
	fsType string
}

// openHealSource opens p, which must resolve to <root>/fuse/<volume>/mnt
// for one of the allowed roots (the FUSE source's layout) and be the root
// of a FUSE mount.
func (e *Executor) openHealSource(p string) (*healSource, error) {
	real, err := resolvePath(p)
	if err != nil {
		return nil, fmt.Errorf("heal source: %w", err)
	}
	if !isFuseMountPoint(real, plan.RealPaths(e.Policy.Roots)) {
		return nil, fmt.Errorf("heal source %s is not <allowed-root>/fuse/<volume>/mnt for any of %v: %w", real, e.Policy.Roots, errdefs.ErrPermissionDenied)
	}
	fd, err := unix.Open(real, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("heal source: %w", mountns.Classify(&os.PathError{Op: "open", Path: real, Err: err}))
	}
	src := &healSource{f: os.NewFile(uintptr(fd), real)}
	if err := src.identify(); err != nil {
		src.f.Close()
		return nil, err
	}
	return src, nil
}

func (src *healSource) identify() error {
	st, err := statxDontSync(src.f)
	if err != nil {
		return err
	}
	if st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return fmt.Errorf("heal source %s is not a mount point (the new daemon is not mounted): %w", src.f.Name(), errdefs.ErrFailedPrecondition)
	}
	id := int(st.Mnt_id)
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) { return i.ID != id, i.ID == id })
	if err != nil {
		return err
	}
	if len(infos) == 0 || !strings.HasPrefix(infos[0].FSType, "fuse") {
		return fmt.Errorf("heal source %s is not a FUSE mount: %w", src.f.Name(), errdefs.ErrPermissionDenied)
	}
	src.conn, src.fsType = connOf(infos[0]), infos[0].FSType
	return nil
}

// isFuseMountPoint reports whether p is <root>/fuse/<volume>/mnt for one
// of roots (internal/source/fuse's layout of a volume's directory).
func isFuseMountPoint(p string, roots []string) bool {
	for _, r := range roots {
		rel, ok := strings.CutPrefix(p, strings.TrimSuffix(r, "/")+"/")
		parts := strings.Split(rel, "/")
		if ok && len(parts) == 3 && parts[0] == "fuse" && parts[2] == "mnt" && parts[1] != "" && parts[1] != "." && parts[1] != ".." {
			return true
		}
	}
	return false
}

// connOf is a FUSE mount's connection ID: its device number as the kernel
// encodes it.
func connOf(i *mountinfo.Info) uint64 { return uint64(i.Major)<<20 | uint64(i.Minor) }

// statxDontSync stats f from what the kernel has cached: on a dead FUSE
// mount a fresh getattr would fail.
func statxDontSync(f *os.File) (unix.Statx_t, error) {
	var st unix.Statx_t
	err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_INO|unix.STATX_MNT_ID, &st)
	if err != nil {
		return st, &os.PathError{Op: "statx", Path: f.Name(), Err: err}
	}
	return st, nil
}

// staleNS is a mount namespace holding mounts of dead connections, as
// /proc/PID/mountinfo of one of its processes showed them.
type staleNS struct {
	pid    int
	inode  uint64
	mounts []*mountinfo.Info // oldest first
}

func (n staleNS) stale(i *mountinfo.Info, id plan.Namespace) plan.StaleMount {
	if id.Inode == 0 {
		id.Inode = n.inode
	}
	return plan.StaleMount{Namespace: id, PID: int64(n.pid), MountPoint: i.Mountpoint, Conn: connOf(i)}
}

// findStale reads the mount table of one process of each mount namespace
// in /proc and returns the namespaces that hold FUSE mounts of the dead
// connections. A process that exits while it is read is passed over; its
// namespace is read through another process if one is left.
func findStale(dead map[uint64]bool) ([]staleNS, error) {
	d, err := os.Open("/proc")
	if err != nil {
		return nil, err
	}
	defer d.Close()
	seen := map[uint64]bool{}
	var out []staleNS
	for {
		names, err := d.Readdirnames(512)
		for _, name := range names {
			if n, ok := readStale(name, dead, seen); ok {
				out = append(out, n)
			}
		}
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("heal: reading /proc: %w", err)
		}
	}
}

func readStale(name string, dead, seen map[uint64]bool) (staleNS, bool) {
	pid, err := strconv.Atoi(name)
	if err != nil || pid <= 0 {
		return staleNS{}, false
	}
	var st unix.Stat_t
	if unix.Stat("/proc/"+name+"/ns/mnt", &st) != nil || seen[st.Ino] {
		return staleNS{}, false
	}
	f, err := os.Open("/proc/" + name + "/mountinfo")
	if err != nil {
		return staleNS{}, false
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(i *mountinfo.Info) (bool, bool) {
		return !dead[connOf(i)] || !strings.HasPrefix(i.FSType, "fuse"), false
	})
	if err != nil {
		return staleNS{}, false
	}
	seen[st.Ino] = true
	return staleNS{pid: pid, inode: st.Ino, mounts: infos}, len(infos) > 0
}

// healer is one HealFuse call's pass over the namespaces.
type healer struct {
	e   *Executor
	src *healSource
	// verdicts caches, per connection, whether it was found dead (nil) or
	// why not: a connection never comes back to life.
	verdicts map[uint64]error
	// reasons says why a mount was not replaced, for Left.
	reasons map[staleKey]string
}

type staleKey struct {
	inode uint64
	id    int
}

// job is one mount to replace: where, and the clone to put there.
type job struct {
	info  *mountinfo.Info
	dir   string // the root below which its mount point is resolved
	clone *os.File
	stale plan.StaleMount
}

// healNamespace replaces n's mounts of dead connections and returns those
// it replaced.
func (hl *healer) healNamespace(ctx context.Context, n staleNS) []plan.StaleMount {
	ns, err := mountns.OpenPID(n.pid, plan.Namespace{Inode: n.inode})
	if err != nil {
		hl.refuseAll(n, fmt.Sprintf("cannot enter its mount namespace: %v", err))
		return nil
	}
	defer ns.Close()
	jobs := hl.prepare(ctx, ns, n)
	defer func() {
		for _, j := range jobs {
			j.clone.Close()
		}
	}()
	var healed []plan.StaleMount
	detachedFirst := 0 // replaced the slow way: see mountns.ReplaceAt
	err = ns.Do(func() error {
		for _, j := range jobs {
			beneath, err := hl.replace(ns, j)
			if err != nil {
				hl.reasons[staleKey{n.inode, j.info.ID}] = err.Error()
				continue
			}
			if !beneath {
				detachedFirst++
			}
			healed = append(healed, j.stale)
		}
		return nil
	})
	if err != nil {
		hl.refuseAll(n, err.Error())
	}
	if len(healed) > 0 {
		klog.FromContext(ctx).Info("Replaced mounts of a dead FUSE connection", "mntNS", ns.Identity(), "pid", n.pid, "mounts", len(healed), "detachedFirst", detachedFirst)
	}
	return healed
}

func (hl *healer) refuseAll(n staleNS, why string) {
	for _, i := range n.mounts {
		hl.reasons[staleKey{n.inode, i.ID}] = why
	}
}

// prepare decides, for each mount of n, whether it may be replaced, and
// builds its clone in the mounter's namespace, where the source is. In
// the mounter's own and the host's namespace only mounts below the kubelet
// dir are replaced: those reach the host.
func (hl *healer) prepare(ctx context.Context, ns *mountns.Namespace, n staleNS) []job {
	which, err := hostSide(ctx, ns)
	if err != nil {
		hl.refuseAll(n, err.Error())
		return nil
	}
	guarded := which != ""
	// A container with a user namespace of its own got its mounts
	// idmapped to it (executor); a clone put in their place must be too,
	// or its root would see the healed volume's files owned by nobody.
	userns, err := ns.UserNS()
	if err != nil {
		hl.refuseAll(n, err.Error())
		return nil
	}
	if userns != nil {
		defer userns.Close()
	}
	var jobs []job
	for _, i := range n.mounts {
		key := staleKey{n.inode, i.ID}
		j := job{info: i, dir: "/", stale: n.stale(i, ns.Identity())}
		if guarded {
			if j.dir = hl.e.kubeletRoot(i.Mountpoint); j.dir == "" {
				hl.reasons[key] = "in " + which + " mount namespace, outside kubelet's directory: never touched"
				continue
			}
		}
		if i.FSType != hl.src.fsType {
			hl.reasons[key] = fmt.Sprintf("a %s mount, and the source is %s", i.FSType, hl.src.fsType)
			continue
		}
		clone, err := mountns.CloneBelow(hl.src.f, strings.TrimSuffix(i.Root, "//deleted"), mountns.AttrOf(i.Options))
		if err != nil {
			hl.reasons[key] = fmt.Sprintf("cloning %s of the source: %v", i.Root, err)
			continue
		}
		if userns != nil {
			if err := mountns.IDMap(clone, userns, i.FSType); err != nil {
				clone.Close()
				hl.reasons[key] = err.Error()
				continue
			}
		}
		j.clone = clone
		jobs = append(jobs, j)
	}
	return jobs
}

// replace puts j's clone in place of its dead mount, after checking that
// the mount on top at its mount point is still that very mount (by mount
// ID and device) and that its connection is dead. Run inside the
// namespace.
func (hl *healer) replace(ns *mountns.Namespace, j job) (beneath bool, err error) {
	root, err := mountns.OpenRoot(j.dir)
	if err != nil {
		return false, err
	}
	defer root.Close()
	t, err := root.Open(j.info.Mountpoint)
	if errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("its mount point is gone: %w", err)
	}
	if err != nil {
		return false, err
	}
	defer t.Close()
	st, err := statxDontSync(t)
	if err != nil {
		return false, err
	}
	dev := uint64(st.Dev_major)<<20 | uint64(st.Dev_minor)
	if st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 || int(st.Mnt_id) != j.info.ID || dev != j.stale.Conn {
		return false, fmt.Errorf("another mount (id %d, device %d) is on top at its mount point", st.Mnt_id, dev)
	}
	if err := hl.checkDead(j.stale.Conn, t); err != nil {
		return false, err
	}
	return ns.ReplaceAt(j.clone, t, func() (*os.File, error) { return root.Open(j.info.Mountpoint) })
}

// checkDead tells whether conn is dead, from a mount of it at t: asked
// for fresh attributes, a dead connection answers ENOTCONN (its daemon
// died, or it was aborted) at once. A connection that answers is never
// replaced; one that does not answer within deadProbeTimeout may have a
// hung daemon, which the plugin must abort first.
func (hl *healer) checkDead(conn uint64, t *os.File) error {
	if v, ok := hl.verdicts[conn]; ok {
		return v
	}
	v := probeDead(t)
	hl.verdicts[conn] = v
	return v
}

func probeDead(t *os.File) error {
	// The probe gets its own descriptor: it may outlive this call.
	fd, err := unix.FcntlInt(t.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() {
		var st unix.Statx_t
		err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_FORCE_SYNC, unix.STATX_TYPE, &st)
		unix.Close(fd)
		done <- err
	}()
	select {
	case err := <-done:
		switch {
		case errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.ECONNABORTED):
			return nil
		case err == nil:
			return fmt.Errorf("its connection answers: only a dead connection's mounts are replaced: %w", errdefs.ErrPermissionDenied)
		default:
			return fmt.Errorf("asked for fresh attributes it answers %v, not ENOTCONN: not known to be dead: %w", err, errdefs.ErrPermissionDenied)
		}
	case <-time.After(deadProbeTimeout):
		return fmt.Errorf("its connection did not answer within %v: not known to be dead (a hung daemon's connection must be aborted first): %w",
			deadProbeTimeout, errdefs.ErrFailedPrecondition)
	}
}

// left reads the mount tables again and lists what still holds a dead
// connection, with the reason this pass left it.
func (hl *healer) left(dead map[uint64]bool) ([]plan.StaleMount, error) {
	after, err := findStale(dead)
	if err != nil {
		return nil, err
	}
	var out []plan.StaleMount
	for _, n := range after {
		id, _ := mountns.IdentityOf(n.pid)
		for _, i := range n.mounts {
			s := n.stale(i, id)
			if s.Reason = hl.reasons[staleKey{n.inode, i.ID}]; s.Reason == "" {
				s.Reason = "not found by this heal's pass (mounted meanwhile, or still there after its replacement)"
			}
			out = append(out, s)
		}
	}
	return out, nil
}
