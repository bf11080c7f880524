package mounter

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/fuseprofile/policy"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Local is the mounter's work done in this process: mountplan-sidecar
// serve runs one and serves it (internal/mounter/service); a plugin started
// without a mounter runs one itself.
type Local struct {
	exec     *Executor
	opts     Options
	records  *registry
	images   []imageRoot
	state    *mountns.Root // the state dir, for the mounts made below it
	spawner  daemon.Spawner
	profiles *policy.Policy

	// What each kind of device or daemon keeps, in a file of its own.
	daemons daemonsState
	cgroups daemonCgroups
	nbd     nbdState
	iscsi   iscsiState
}

var _ Node = (*Local)(nil)

// imageRoot is a directory below which loop devices may be backed:
// base is trusted as given (the admin's), sub is the part below it that
// is resolved without symlinks ("" for an admin's image root itself,
// "images" below the state dir, which the plugin writes).
type imageRoot struct {
	base, sub string
}

func (r imageRoot) dir() string { return filepath.Join(r.base, r.sub) }

// NewNode opens the records and takes back the devices they name that
// are still there (see registry.load).
func NewNode(ctx context.Context, o Options) (*Local, error) {
	if !plan.IsCleanAbs(o.StateDir) || o.RecordsDir == "" {
		return nil, fmt.Errorf("mounter: a clean absolute state dir and a records dir are required: %w", errdefs.ErrInvalidArgument)
	}
	if o.Config == nil {
		o.Config = &config.Config{DefaultFsType: "ext4"}
	}
	if err := os.MkdirAll(o.StateDir, 0o700); err != nil {
		return nil, err
	}
	if !o.Observe {
		if err := protectStateDir(o.StateDir); err != nil {
			return nil, err
		}
	}
	state, err := mountns.OpenRoot(o.StateDir)
	if err != nil {
		return nil, fmt.Errorf("mounter: state dir: %w", err)
	}
	n := &Local{opts: o, state: state, spawner: o.Spawner}
	if !o.Observe {
		n.claimOwnDirs(ctx)
	}
	if n.spawner == nil {
		n.spawner = daemon.LocalSpawner{}
	}
	n.images = append(n.images, imageRoot{base: o.StateDir, sub: "images"})
	for _, r := range o.Config.ImageRoots {
		n.images = append(n.images, imageRoot{base: filepath.Clean(r)})
	}
	n.exec = &Executor{
		Policy:           o.Config.PlanPolicy(o.StateDir),
		KubeletDir:       o.KubeletDir,
		RemoveMountPoint: o.RemoveMountPoint,
		AllowPropagation: o.AllowPropagation,
		sources:          n,
	}
	n.profiles = policy.For(o.Config, []string{o.StateDir})
	if n.records, err = openRegistry(o.RecordsDir, o.Observe); err != nil {
		state.Close()
		return nil, err
	}
	if n.exec.attrib, err = openAttribution(o.RecordsDir, n.records.boot, o.Observe, o.Attributed); err != nil {
		state.Close()
		return nil, err
	}
	if n.exec.attrib != nil && !o.Observe {
		n.exec.attrib.prune(ctx)
	}
	if err := n.records.load(ctx, n); err != nil {
		klog.FromContext(ctx).Error(err, "Some of the mounter's records could not be taken back")
	}
	if !o.Observe {
		if err := n.clearScratch(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Some private mounts of an earlier mounter are left")
		}
	}
	// Each reads its records; one that observes (Options.Observe) holds,
	// takes back and writes nothing.
	for _, init := range []func(context.Context) error{n.initDaemons, n.initNBD, n.initISCSI} {
		if err := init(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Some of the mounter's records could not be taken back")
		}
	}
	return n, nil
}

// Close lets go of the held loop devices (the kernel clears those nothing
// mounts) and the state dir.
func (n *Local) Close() error {
	n.records.closeLoops()
	return n.state.Close()
}

// Executor is the node's plan executor, for the one-shot sidecar commands
// that need UnmountAll.
func (n *Local) Executor() *Executor { return n.exec }

// Mount performs a plan (Executor.Mount) whose devices and bind sources the
// node set up.
func (n *Local) Mount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	return n.exec.Mount(ctx, mounts, c)
}

// Unmount undoes a plan (Executor.Unmount).
func (n *Local) Unmount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error {
	return n.exec.Unmount(ctx, mounts, c)
}

// HealFuse heals the mounts of dead FUSE connections (Executor.HealFuse).
func (n *Local) HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error) {
	return n.exec.HealFuse(ctx, h)
}

// volumeDir returns <state-dir>/<kind>/<id> for a volume ID that is safe
// as one path component.
func (n *Local) volumeDir(kind, id string) (string, error) {
	if err := model.ValidID(id); err != nil {
		return "", err
	}
	return filepath.Join(n.opts.StateDir, kind, id), nil
}

// UnmountAll removes everything at or below c's mount point
// (Executor.UnmountAll).
func (n *Local) UnmountAll(ctx context.Context, c plan.Consumer) error {
	return n.exec.UnmountAll(ctx, c)
}

// claimOwnDirs makes the mounter's directories of the state dir (fuse/,
// nri/) its own at start, before the plugin, which can create entries in
// the state dir, could make one first and plant a volume's work/ below it
// for a daemon to follow (review of b705b24, F17). A directory someone
// else made is taken over and said so; one that cannot be made (a symlink
// planted there) is said so too, and every later use of it is refused as
// before. A node without CAP_CHOWN is a plugin's own mounter (see
// protectStateDir): nothing to keep from it.
func (n *Local) claimOwnDirs(ctx context.Context) {
	owner := &daemon.User{UID: fsutil.MounterUID, GID: fsutil.MounterGID}
	for _, name := range []string{"fuse", "nri"} {
		dir := filepath.Join(n.opts.StateDir, name)
		var st unix.Stat_t
		if err := unix.Lstat(dir, &st); err == nil && st.Uid != fsutil.MounterUID && os.Geteuid() == 0 {
			klog.FromContext(ctx).Error(nil, "A directory of the mounter's in the state dir was made by someone else; taking it over (check what is in it)", "dir", dir, "uid", st.Uid)
		}
		err := n.makeDir(dir, 0o755, owner)
		if errors.Is(err, fs.ErrPermission) { // chown without CAP_CHOWN
			return
		}
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot make a directory of the mounter's in the state dir", "dir", dir)
		}
	}
}

// protectStateDir gives the state dir to fsutil.MounterUID, sticky and
// writable by the plugin's group (fsutil.StateDirMode): the plugin keeps
// adding its own entries but can no longer rename or remove the mounter's.
// A node without CAP_CHOWN is a plugin's own mounter, run unprivileged:
// there is no boundary between them to keep, and it leaves the dir as is.
func protectStateDir(dir string) error {
	f, err := os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return fmt.Errorf("mounter: state dir: %w", err)
	}
	defer f.Close()
	if err := f.Chown(fsutil.MounterUID, 0); errors.Is(err, fs.ErrPermission) {
		return nil
	} else if err != nil {
		return fmt.Errorf("mounter: state dir: %w", err)
	}
	if err := f.Chmod(fsutil.StateDirMode); err != nil {
		return fmt.Errorf("mounter: state dir: %w", err)
	}
	return nil
}
