// Package guard is what stands at kubelet's target path of a volume
// published in NRI mode, instead of the volume (see Guard).
package guard

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// FSType is the guard's filesystem type as mount tables show it.
const FSType = "fuse." + guardName

const guardName = "mountplan-nri-guard"

// Path is where the live guard is reached under the state dir: a symlink
// to its mount point, which the plugin's NRI-mode publish binds at
// kubelet's target path. Nothing is there while no hook is registered.
func Path(stateDir string) string { return filepath.Join(stateDir, "nri", "guard") }

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
type Guard struct {
	dir   string // <state-dir>/nri
	mnt   string // where this guard's filesystem is mounted
	dev   *os.File
	devno uint64 // its filesystem's device number
	done  chan struct{}
}

// Start mounts a new guard under stateDir, serves it, points Path at it
// and removes what earlier guards left there.
func Start(stateDir string) (_ *Guard, err error) {
	g := &Guard{dir: filepath.Dir(Path(stateDir)), done: make(chan struct{})}
	if err := os.MkdirAll(g.dir, 0o700); err != nil {
		return nil, err
	}
	g.mnt = filepath.Join(g.dir, "g-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	if err := os.Mkdir(g.mnt, 0o755); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			g.stop()
		}
	}()
	if err := g.mount(); err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Stat(g.mnt, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: g.mnt, Err: err}
	}
	g.devno = uint64(st.Dev) //nolint:unconvert // Dev is uint32 on some architectures
	tmp := Path(stateDir) + ".new"
	_ = os.Remove(tmp)
	if err := os.Symlink(filepath.Base(g.mnt), tmp); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, Path(stateDir)); err != nil {
		return nil, err
	}
	return g, g.removeStale()
}

// mount opens /dev/fuse, mounts the filesystem read-only at g.mnt and
// starts serving it.
func (g *Guard) mount() error {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: "/dev/fuse", Err: err}
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40555,user_id=0,group_id=0", fd)
	if err := unix.Mount(guardName, g.mnt, FSType, unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		unix.Close(fd)
		return &os.PathError{Op: "mount " + FSType, Path: g.mnt, Err: err}
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
	go func() { serveFuse(g.dev); close(g.done) }()
	return nil
}

// Source is the mount point of this guard's filesystem.
func (g *Guard) Source() string { return g.mnt }

// Stop unpoints Path, aborts the connection (every target still bound
// to this guard now fails with ENOTCONN) and unmounts the guard's own
// mount point.
func (g *Guard) Stop() error {
	link := filepath.Join(g.dir, "guard")
	if dest, err := os.Readlink(link); err == nil && dest == filepath.Base(g.mnt) {
		_ = os.Remove(link)
	}
	return g.stop()
}

func (g *Guard) stop() error {
	if g.dev != nil {
		g.dev.Close()
		<-g.done
		g.dev = nil
	}
	if err := mountns.Unmount(g.mnt, true); err != nil {
		return err
	}
	if err := unix.Rmdir(g.mnt); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "rmdir", Path: g.mnt, Err: err}
	}
	return nil
}

// removeStale detaches and removes the mount points of earlier guards.
func (g *Guard) removeStale() error {
	entries, err := os.ReadDir(g.dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		p := filepath.Join(g.dir, e.Name())
		if !strings.HasPrefix(e.Name(), "g-") || p == g.mnt {
			continue
		}
		if err := mountns.Unmount(p, true); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := unix.Rmdir(p); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, &os.PathError{Op: "rmdir", Path: p, Err: err})
		}
	}
	return errors.Join(errs...)
}

// Owns reports whether path (a container mount's source) is bound to this
// guard: a target published in NRI mode. A target bound to a dead guard
// is an error: Rearm has not reached it.
func (g *Guard) Owns(path string) (bool, error) {
	var st unix.Stat_t
	err := unix.Stat(path, &st)
	if errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.ECONNABORTED) {
		return false, fmt.Errorf("%s is bound to the guard of a mounter that is gone: %w", path, err)
	}
	if err != nil {
		return false, nil // not ours to judge: the runtime reports it
	}
	return uint64(st.Dev) == g.devno, nil //nolint:unconvert // Dev is uint32 on some architectures
}

// Rearm binds this guard at every mount point under root (kubelet's
// directory) where a dead guard is mounted, in this process's mount
// namespace: the targets published while an earlier mounter served. It
// returns how many it re-armed.
func (g *Guard) Rearm(root string) (int, error) {
	stale, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return i.FSType != FSType || !plan.Within(root, i.Mountpoint) ||
			unix.Mkdev(uint32(i.Major), uint32(i.Minor)) == g.devno, false
	})
	if err != nil {
		return 0, err
	}
	n := 0
	var errs []error
	for _, i := range stale {
		if err := g.arm(i.Mountpoint); err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// arm replaces what is mounted at target by a bind of this guard.
func (g *Guard) arm(target string) error {
	if err := mountns.Unmount(target, true); err != nil {
		return err
	}
	fd, err := mountns.Build(Bind(g.mnt))
	if err != nil {
		return err
	}
	defer fd.Close()
	return mountns.Attach(fd, target)
}

// Bind is the plan that binds a guard at a target.
func Bind(source string) plan.Mount {
	return plan.Mount{Type: plan.TypeBind, Source: source, Options: []string{"ro", "nosuid", "nodev", "noexec"}}
}
