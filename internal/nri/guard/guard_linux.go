// Package guard is what stands at kubelet's target path of a volume
// published in NRI mode, instead of the volume (see Guard).
package guard

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/blocking"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// FSType is the guard's filesystem type as mount tables show it.
const FSType = "fuse." + guardName

const guardName = "mountplan-nri-guard"

// linkName is the symlink, in <state-dir>/nri, to the live guard's mount
// point; mountPrefix starts the name of every guard's mount point there.
const (
	linkName    = "guard"
	mountPrefix = "g-"
)

// Path is where the live guard is announced under the state dir: a
// symlink to its mount point (Source resolves it). Nothing is there while
// no hook is registered.
func Path(stateDir string) string { return filepath.Join(stateDir, "nri", linkName) }

// Source returns the mount point of the live guard below stateDir, which
// the plugin's NRI-mode publish binds at kubelet's target path: the
// resolved path, since the mounter follows no symlink in a bind's source.
// It wraps fs.ErrNotExist when no guard runs.
func Source(stateDir string) (string, error) {
	dest, err := os.Readlink(Path(stateDir))
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(dest, mountPrefix) || strings.Contains(dest, "/") {
		return "", fmt.Errorf("%s leads to %q, not a guard's mount point: %w", Path(stateDir), dest, errdefs.ErrFailedPrecondition)
	}
	return filepath.Join(filepath.Dir(Path(stateDir)), dest), nil
}

// IsSource reports whether p names a guard's mount point (Source's form:
// <state-dir>/nri/g-...) or a target's directory in one (At's form), live
// or long gone. A plan that binds one binds whichever guard stands at its
// target: Rearm replaces a dead guard's bind with the live one's, so a
// publish recorded while an earlier guard served is undone by unmounting
// the guard that is there now.
func IsSource(p string) bool {
	isMount := func(p string) bool {
		return filepath.Base(filepath.Dir(p)) == "nri" && strings.HasPrefix(filepath.Base(p), mountPrefix)
	}
	return isMount(p) || isMount(filepath.Dir(p)) && validName(filepath.Base(p))
}

// At is what a publish at kubelet's target binds there: the directory of
// the guard at source named after the target (Dir). Every target so bound
// is told apart by the guard: a subPath of it that kubelet binds for a
// container leads the hook back to its target (Guard.Locate).
func At(source, target string) string { return filepath.Join(source, Dir(target)) }

// Dir is the name of target's directory in a guard: the name kubelet's
// target path gives the volume in its pod
// (<pods>/<uid>/volumes/kubernetes.io~csi/<name>/mount).
func Dir(target string) string { return filepath.Base(filepath.Dir(target)) }

// TargetIn is the target of the volume named name in the pod directory
// podDir (<pods>/<uid>), as kubelet lays it out; Dir's inverse.
func TargetIn(podDir, name string) string {
	return filepath.Join(podDir, "volumes", "kubernetes.io~csi", name, "mount")
}

func validName(name string) bool {
	return name != "" && name != "." && name != ".." && name != "/" && !strings.Contains(name, "/")
}

// Recorder is told of the guard's mount point, so that a bind of it
// passes the mounter's check of bind sources (mounter.Local is one).
type Recorder interface {
	// RecordGuard records root, the guard's mount root at path.
	RecordGuard(path string, root *os.File) error
	// ForgetGuard forgets the guard recorded at path.
	ForgetGuard(path string) error
}

// Guard is what stands at kubelet's target path of a volume published in
// NRI mode instead of the volume: an empty, read-only FUSE filesystem that
// this process serves while, and only while, the hook is registered with
// the runtime. Its attributes are never cached, so
//
//   - while the hook is registered, the runtime (and kubelet) can stat the
//     target, as they do before creating a container, and the hook replaces
//     the container's bind of it with the volume's mounts;
//   - once the hook is gone (the mounter died, was stopped, or lost the
//     runtime), the connection is aborted and even a stat of the target
//     fails with ENOTCONN ("transport endpoint is not connected"): a
//     container created then fails to be created or started, instead of
//     getting an empty directory of the node's disk in place of its volume.
//
// A new guard re-arms the targets left bound to a dead one (Rearm).
//
// The plugin (unprivileged, but the owner of the state dir) may rename or
// replace anything there: every step below <state-dir>/nri goes through
// that directory's descriptor, opened without following a symlink, and
// names entries in it, never a path resolved again.
type Guard struct {
	dir   *os.File // <state-dir>/nri, O_PATH
	path  string   // its path, for messages and records
	name  string   // this guard's mount point in dir
	rec   Recorder
	dev   *os.File
	devno uint64 // its filesystem's device number
	tree  *tree  // what the guard's filesystem has named
	done  chan struct{}
}

// Start mounts a new guard under stateDir, serves it, records it with rec
// (if any), points Path at it and removes what earlier guards left there.
func Start(stateDir string, rec Recorder) (_ *Guard, err error) {
	g := &Guard{
		path: filepath.Dir(Path(stateDir)),
		name: mountPrefix + strconv.FormatInt(time.Now().UnixNano(), 36),
		rec:  rec,
		tree: newTree(),
		done: make(chan struct{}),
	}
	if g.dir, err = openDir(stateDir, g.path); err != nil {
		return nil, err
	}
	if err := unix.Mkdirat(g.fd(), g.name, 0o755); err != nil {
		g.dir.Close()
		return nil, &os.PathError{Op: "mkdirat", Path: g.mnt(), Err: err}
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, g.stop())
		}
	}()
	if err := g.mount(); err != nil {
		return nil, err
	}
	root, err := g.open(g.name)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(root.Fd()), &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: g.mnt(), Err: err}
	}
	g.devno = uint64(st.Dev) //nolint:unconvert // Dev is uint32 on some architectures
	if st.Dev == g.parentDev() {
		return nil, fmt.Errorf("%s: no guard is mounted there after mounting it", g.mnt())
	}
	if g.rec != nil {
		if err := g.rec.RecordGuard(g.mnt(), root); err != nil {
			return nil, err
		}
	}
	if err := g.announce(); err != nil {
		return nil, err
	}
	return g, g.removeStale()
}

// openDir makes dir (below stateDir) and opens it, never through a symlink.
func openDir(stateDir, dir string) (*os.File, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil { // the admin's path
		return nil, err
	}
	root, err := mountns.OpenRoot(stateDir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	if _, err := root.MkdirAll(dir, false); err != nil {
		return nil, err
	}
	f, err := root.Open(dir)
	if err != nil {
		return nil, err
	}
	// The mounter's (fsutil.MounterUID): the plugin reads the symlink but
	// cannot change it or plant a guard's name.
	if err := unix.Chown(procFd(f), fsutil.MounterUID, fsutil.MounterGID); err != nil {
		f.Close()
		return nil, &os.PathError{Op: "chown", Path: dir, Err: err}
	}
	if err := unix.Chmod(procFd(f), 0o755); err != nil {
		f.Close()
		return nil, &os.PathError{Op: "chmod", Path: dir, Err: err}
	}
	return f, nil
}

func (g *Guard) fd() int            { return int(g.dir.Fd()) }
func (g *Guard) mnt() string        { return filepath.Join(g.path, g.name) }
func (g *Guard) at(n string) string { return filepath.Join(g.path, n) }

// open opens the entry name of the guard's directory (O_PATH), never a
// symlink.
func (g *Guard) open(name string) (*os.File, error) {
	fd, err := unix.Openat(g.fd(), name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	runtime.KeepAlive(g.dir)
	if err != nil {
		return nil, &os.PathError{Op: "openat", Path: g.at(name), Err: err}
	}
	return os.NewFile(uintptr(fd), g.at(name)), nil
}

func (g *Guard) parentDev() uint64 {
	var st unix.Stat_t
	if unix.Fstat(g.fd(), &st) != nil {
		return 0
	}
	return uint64(st.Dev) //nolint:unconvert // Dev is uint32 on some architectures
}

// mount opens /dev/fuse, mounts the filesystem read-only on the guard's
// directory (reached through its descriptor: the kernel follows the magic
// link /proc/self/fd/N to exactly that directory) and starts serving it.
func (g *Guard) mount() error {
	at, err := g.open(g.name)
	if err != nil {
		return err
	}
	defer at.Close()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: "/dev/fuse", Err: err}
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40555,user_id=0,group_id=0", fd)
	err = unix.Mount(guardName, procFd(at), FSType, unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts)
	runtime.KeepAlive(at)
	if err != nil {
		unix.Close(fd)
		return &os.PathError{Op: "mount " + FSType, Path: g.mnt(), Err: err}
	}
	// Only now, with a connection behind it, can the device be polled:
	// made non-blocking, os.NewFile hands it to Go's poller, and Close can
	// then end a pending read (a blocking read would keep the connection
	// alive after Stop).
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return err
	}
	g.dev = os.NewFile(uintptr(fd), "/dev/fuse")
	go func() { g.tree.serveFuse(g.dev); close(g.done) }()
	return nil
}

func procFd(f *os.File) string { return "/proc/self/fd/" + strconv.Itoa(int(f.Fd())) }

// announce points Path at this guard: a new symlink renamed over the old.
func (g *Guard) announce() error {
	tmp := linkName + ".new"
	if err := unix.Unlinkat(g.fd(), tmp, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "unlinkat", Path: g.at(tmp), Err: err}
	}
	if err := unix.Symlinkat(g.name, g.fd(), tmp); err != nil {
		return &os.PathError{Op: "symlinkat", Path: g.at(tmp), Err: err}
	}
	if err := unix.Renameat(g.fd(), tmp, g.fd(), linkName); err != nil {
		return &os.PathError{Op: "renameat", Path: g.at(linkName), Err: err}
	}
	runtime.KeepAlive(g.dir)
	return nil
}

// Source is the mount point of this guard's filesystem.
func (g *Guard) Source() string { return g.mnt() }

// Stop unpoints Path, aborts the connection (every target still bound
// to this guard now fails with ENOTCONN) and unmounts the guard's own
// mount point.
func (g *Guard) Stop() error {
	buf := make([]byte, unix.NAME_MAX)
	if n, err := unix.Readlinkat(g.fd(), linkName, buf); err == nil && string(buf[:n]) == g.name {
		_ = unix.Unlinkat(g.fd(), linkName, 0)
	}
	return g.stop()
}

func (g *Guard) stop() error {
	if g.dev != nil {
		g.dev.Close()
		<-g.done
		g.dev = nil
	}
	err := g.remove(g.name)
	if g.dir != nil {
		g.dir.Close()
		g.dir = nil
	}
	return err
}

// remove detaches the mounts on the entry name of the guard's directory,
// removes it, and forgets its record.
func (g *Guard) remove(name string) error {
	for range maxStacked {
		f, err := g.open(name)
		if errors.Is(err, fs.ErrNotExist) {
			break
		}
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err == nil && uint64(st.Dev) == g.parentDev() { //nolint:unconvert // Dev is uint32 on some architectures
			f.Close()
			break // nothing (left) mounted on it
		}
		// A dead guard's root fails the stat (ENOTCONN): unmount it too.
		err = unix.Unmount(procFd(f), unix.MNT_DETACH)
		f.Close()
		if errors.Is(err, unix.EINVAL) {
			break
		}
		if err != nil {
			return &os.PathError{Op: "umount2", Path: g.at(name), Err: err}
		}
	}
	err := unix.Unlinkat(g.fd(), name, unix.AT_REMOVEDIR)
	if errors.Is(err, unix.ENOTDIR) { // planted (a symlink): removed, never followed
		err = unix.Unlinkat(g.fd(), name, 0)
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "remove", Path: g.at(name), Err: err}
	}
	runtime.KeepAlive(g.dir)
	if g.rec != nil {
		return g.rec.ForgetGuard(g.at(name))
	}
	return nil
}

// maxStacked bounds the mounts removed from one entry.
const maxStacked = 16

// removeStale detaches and removes the mount points of earlier guards.
func (g *Guard) removeStale() error {
	d, err := g.open(".")
	if err != nil {
		return err
	}
	// An O_PATH descriptor cannot be listed: reopen the very directory.
	dir, err := os.Open(procFd(d))
	d.Close()
	if err != nil {
		return err
	}
	names, err := dir.Readdirnames(-1)
	dir.Close()
	if err != nil {
		return err
	}
	var errs []error
	for _, name := range names {
		if strings.HasPrefix(name, mountPrefix) && name != g.name {
			errs = append(errs, g.remove(name))
		}
	}
	return errors.Join(errs...)
}

// Locate says where in this guard path (a container mount's source) is:
// the name of a target's directory and the subPath below it (both empty
// for the guard's root, which publishes of an earlier version bound). ours
// is false for anything not on this guard; a path bound to a dead guard
// (Rearm has not reached it) is an error, and so is a path whose
// filesystem has not answered the stat by ctx's end (ErrUnavailable: a
// pod's sshfs volume whose server hangs, say; without the answer nobody
// can tell whether the path is on the guard).
func (g *Guard) Locate(ctx context.Context, path string) (name, sub string, ours bool, err error) {
	st, err := blocking.Stat(ctx, path)
	if errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.ECONNABORTED) {
		return "", "", false, fmt.Errorf("%s is bound to the guard of a mounter that is gone: %w", path, err)
	}
	if errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, errdefs.ErrResourceExhausted) {
		return "", "", false, err
	}
	if err != nil || uint64(st.Dev) != g.devno { //nolint:unconvert // Dev is uint32 on some architectures
		return "", "", false, nil // not ours to judge: the runtime reports it
	}
	p, ok := g.tree.pathOf(st.Ino)
	if !ok {
		return "", "", false, fmt.Errorf("%s is on the guard, at a name it no longer holds: %w", path, errdefs.ErrFailedPrecondition)
	}
	name, sub, _ = strings.Cut(p, "/")
	return name, sub, true, nil
}

// Rearm binds this guard at every mount point under root (kubelet's
// directory) where a dead guard is on top, in this process's mount
// namespace: the targets published while an earlier mounter served. It
// returns how many it re-armed.
func (g *Guard) Rearm(root string) (int, error) {
	below, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return !plan.Within(root, i.Mountpoint) || i.Mountpoint == root, false
	})
	if err != nil {
		return 0, err
	}
	stacks := map[string][]*mountinfo.Info{}
	for _, i := range below {
		stacks[i.Mountpoint] = append(stacks[i.Mountpoint], i)
	}
	var stale []*mountinfo.Info
	for _, stack := range stacks {
		if top := mountns.Top(stack); top != nil && top.FSType == FSType && unix.Mkdev(uint32(top.Major), uint32(top.Minor)) != g.devno {
			stale = append(stale, top)
		}
	}
	if len(stale) == 0 {
		return 0, nil
	}
	r, err := mountns.OpenRoot(root)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	n := 0
	var errs []error
	for _, i := range stale {
		if err := g.arm(r, i); err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// arm puts a bind of this guard in place of the dead guard i at its mount
// point, never leaving the mount point bare (a container created then
// would get the directory beneath, and a mounter killed then would leave
// it so): beneath the dead guard, which then goes; where the kernel
// refuses that (a shared parent, as kubelet's directory is), on top of
// it, where the dead one stays beneath until the target is unpublished
// (the mounter's unmount of a guard's bind removes every guard there).
// The plugin can rename kubelet's directories (not the mount points, but
// their parents): the mount point is reached below root without a
// symlink, and only the very mount the table showed is replaced.
func (g *Guard) arm(root *mountns.Root, i *mountinfo.Info) error {
	t, err := root.Open(i.Mountpoint)
	if err != nil {
		return err
	}
	defer t.Close()
	if id, err := mountIDOf(t); err != nil || id != i.ID {
		return fmt.Errorf("%s is no longer the dead guard's mount %d (it is %d, %v): %w", i.Mountpoint, i.ID, id, err, errdefs.ErrFailedPrecondition)
	}
	src, err := g.openBelow(strings.TrimPrefix(i.Root, "/"))
	if err != nil {
		return err
	}
	defer src.Close()
	fd, err := mountns.BuildFrom(Bind(filepath.Join(g.mnt(), i.Root)), src)
	if err != nil {
		return err
	}
	defer fd.Close()
	err = mountns.AttachBeneath(fd, t)
	if errors.Is(err, unix.EINVAL) {
		return mountns.AttachAt(fd, t)
	}
	if err != nil {
		return err
	}
	if err := unix.Unmount(procFd(t), unix.MNT_DETACH); err != nil {
		return &os.PathError{Op: "umount2", Path: i.Mountpoint, Err: err}
	}
	return nil
}

// openBelow opens rel (clean, relative; "" for the root) in this guard's
// filesystem (O_PATH), never through a symlink: the directory the dead
// guard's bind showed (a target's, a subPath's) has its twin here.
func (g *Guard) openBelow(rel string) (*os.File, error) {
	root, err := g.open(g.name)
	if err != nil || rel == "" {
		return root, err
	}
	defer root.Close()
	if !filepath.IsLocal(rel) {
		return nil, fmt.Errorf("%q is not a path below a guard's root: %w", rel, errdefs.ErrFailedPrecondition)
	}
	fd, err := mountns.Openat2(int(root.Fd()), rel, unix.O_PATH|unix.O_CLOEXEC, 0, mountns.ResolveBelow)
	runtime.KeepAlive(root)
	if err != nil {
		return nil, &os.PathError{Op: "openat2", Path: filepath.Join(g.mnt(), rel), Err: err}
	}
	return os.NewFile(uintptr(fd), filepath.Join(g.mnt(), rel)), nil
}

// mountIDOf reads the ID of the mount f is on from /proc: a stat of a dead
// guard's root would fail (ENOTCONN).
func mountIDOf(f *os.File) (int, error) {
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(int(f.Fd())))
	runtime.KeepAlive(f)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "mnt_id:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("no mnt_id in the fdinfo of %s", f.Name())
}

// Bind is the plan that binds a guard at a target.
func Bind(source string) plan.Mount {
	return plan.Mount{Type: plan.TypeBind, Source: source, Options: []string{"ro", "nosuid", "nodev", "noexec"}}
}
