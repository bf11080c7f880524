package mounter

// fd mode (a profile's fdMount): the mounter mounts, the daemon only
// serves. The mounter opens /dev/fuse itself, makes the FUSE mount on the
// volume's mnt/ (resolved below the state dir without following a
// symlink) with fd=N and the options the profile allows, and starts the
// daemon with the descriptor as its fd 3 and /dev/fd/3 as its mount point
// (libfuse >= 3.3). The daemon then needs no capability, never opens
// /dev/fuse (which may be mode 0600) and runs as a user other than root.
// Everything after the start is as for a daemon that mounts by itself:
// waitReady finds the mount and waits for the daemon's answer, the mount
// and the connection are recorded, and a restart makes a fresh mount.

import (
	"context"
	"fmt"
	"os"
	"slices"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// fuseDevice is the FUSE device the mounter opens in fd mode.
const fuseDevice = "/dev/fuse"

// spawnDaemon starts cmd, in fd mode once the mounter has mounted the
// volume's FUSE filesystem itself and with its descriptor.
func (n *Local) spawnDaemon(ctx context.Context, l fuseLayout, prof *fuseprofile.Profile, req DaemonRequest, cmd daemon.Command) (daemon.Proc, error) {
	if !prof.FdMount {
		if req.SELinuxContext != "" {
			// The daemon's own mount takes whatever options it passes;
			// only the mounter's mount is known to carry the label.
			return daemon.Proc{}, fmt.Errorf("fuse profile %s: volume %s asks for SELinux context %q, which only a FUSE mount the mounter makes carries: set fdMount: true in the profile: %w",
				prof.Name, req.VolumeID, req.SELinuxContext, errdefs.ErrFailedPrecondition)
		}
		return n.spawner.Spawn(ctx, cmd)
	}
	dev, err := n.mountFuse(ctx, l, prof, req, cmd)
	if err != nil {
		return daemon.Proc{}, err
	}
	cmd.Fuse = dev
	if cmd.Sandbox, err = daemonSandbox(l, prof, cmd); err != nil {
		dev.Close()
		return daemon.Proc{}, err
	}
	proc, err := n.spawner.Spawn(ctx, cmd)
	// The daemon holds the connection alone. The kernel aborts a FUSE
	// connection when the last descriptor of it is closed: a copy kept
	// here would keep a dead daemon's connection alive, and its consumers
	// would hang on it instead of getting ENOTCONN and being healed. A
	// failed start leaves no holder at all: the connection is aborted, and
	// the caller's rollback unmounts it.
	dev.Close()
	return proc, err
}

// mountFuse opens /dev/fuse and mounts a FUSE filesystem of it on the
// volume's mnt/ for a daemon of cmd's user, with prof's options (each
// checked by the mounter's plan policy too). It returns the device, which
// the caller hands to the daemon and then closes.
func (n *Local) mountFuse(ctx context.Context, l fuseLayout, prof *fuseprofile.Profile, req DaemonRequest, cmd daemon.Command) (_ *os.File, err error) {
	if cmd.RunAs == nil || cmd.RunAs.UID == 0 || cmd.RunAs.GID == 0 || len(cmd.Capabilities) > 0 {
		// fuseprofile renders none such; a daemon that gets the mount
		// must not be privileged besides.
		return nil, fmt.Errorf("fuse profile %s: a daemon in fd mode runs as a user other than root without capabilities: %w", prof.Name, errdefs.ErrFailedPrecondition)
	}
	fd, err := unix.Open(fuseDevice, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fd mode: open %s: %w: %w", fuseDevice, err, errdefs.ErrFailedPrecondition)
	}
	dev := os.NewFile(uintptr(fd), fuseDevice)
	defer func() {
		if err != nil {
			dev.Close()
		}
	}()
	opts := append([]string{fmt.Sprintf("fd=%d", fd)}, prof.FuseMountOptions(req.ReadOnly, *cmd.RunAs)...)
	opts = withLabel(opts, req.SELinuxContext)
	for _, o := range opts {
		if err := n.exec.Policy.CheckOption(o); err != nil {
			return nil, fmt.Errorf("fuse profile %s: the mount's options: %w", prof.Name, err)
		}
	}
	// The mount's source names the volume's source, as libfuse daemons
	// such as sshfs name their own mounts; it is a label to the kernel.
	src := prof.FuseSubtype()
	if cmd.Spec != nil && cmd.Spec.Params[fuseprofile.CtxSource] != "" {
		src = cmd.Spec.Params[fuseprofile.CtxSource]
	}
	mnt, err := mountns.BuildFrom(plan.Mount{Type: "fuse", Source: src, Options: opts}, nil)
	if err != nil {
		return nil, fmt.Errorf("fd mode: FUSE mount for volume %s: %w", req.VolumeID, err)
	}
	defer mnt.Close()
	target, err := n.state.Open(l.mnt()) // O_PATH, no symlink followed
	if err != nil {
		return nil, err
	}
	defer target.Close()
	if err := mountns.AttachAt(mnt, target); err != nil {
		return nil, fmt.Errorf("fd mode: FUSE mount for volume %s: %w", req.VolumeID, err)
	}
	klog.FromContext(ctx).V(2).Info("Mounted FUSE for a daemon in fd mode", "volume", req.VolumeID, "mountPoint", l.realMnt(),
		"type", "fuse."+prof.FuseSubtype(), "options", opts[1:])
	return dev, nil
}

// daemonSandbox is what the root of cmd's daemon holds of the node
// besides the system's directories (daemon.Sandbox): its volume's work/
// (writable) and secrets/ (read-only, when it has secrets), the root of
// its source (read-only) when the profile's sources are paths under roots,
// and its binary when no system directory holds it. Nothing else of the
// state dir, the kubelet dir, /dev or other volumes: the daemon serves
// its mount through its descriptor and needs not see it.
func daemonSandbox(l fuseLayout, prof *fuseprofile.Profile, cmd daemon.Command) (*daemon.Sandbox, error) {
	sb := &daemon.Sandbox{Writable: []string{l.realWork()}}
	if cmd.Spec != nil && len(cmd.Spec.Secrets) > 0 {
		sb.ReadOnly = append(sb.ReadOnly, l.realSecrets())
	}
	if len(prof.Source.Roots) > 0 && cmd.Spec != nil {
		// The rendered {source} is the real path (symlinks resolved):
		// the real root that holds it is bound at its own path.
		src, err := prof.ResolveSource(cmd.Spec.Params[fuseprofile.CtxSource])
		if err != nil {
			return nil, err
		}
		i := slices.IndexFunc(plan.RealPaths(prof.Source.Roots), func(r string) bool { return plan.Within(r, src) })
		if i < 0 {
			return nil, fmt.Errorf("fuse profile %s: the source is under none of its roots: %w", prof.Name, errdefs.ErrInvalidArgument)
		}
		sb.ReadOnly = append(sb.ReadOnly, plan.RealPaths(prof.Source.Roots)[i])
	}
	if !plan.WithinAny(daemon.SystemPaths, cmd.Path) {
		sb.ReadOnly = append(sb.ReadOnly, cmd.Path)
	}
	return sb, nil
}
