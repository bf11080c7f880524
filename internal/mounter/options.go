package mounter

import (
	"path/filepath"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
)

// Options configure a Local node.
type Options struct {
	// StateDir is the plugin's state dir (the sidecar's --state-dir):
	// the one place where the mounter mounts for the plugin (overlay
	// chains, FUSE daemons, the NRI guard) and where provisioned images
	// live (StateDir/images). The mounter trusts the path as given, and
	// nothing the plugin wrote below it: every path below it is opened
	// without following a symlink.
	StateDir string
	// KubeletDir is kubelet's root directory: kubelet's publishes (the
	// mounter's own namespace) are performed only below it.
	KubeletDir string
	// RecordsDir keeps the mounter's records of what it set up; only the
	// mounter may reach it: outside the state dir (DefaultRecordsDir), in
	// the chart a host directory the plugin's pod does not mount.
	RecordsDir string
	// Config is the admin's config: the plan policy, the static image
	// roots, the FUSE profiles, the iSCSI settings.
	Config *config.Config
	// DaemonCgroup is the cgroup v2 directory below which each FUSE
	// daemon gets a cgroup of its own with its profile's limits
	// (internal/daemon/cgroup); CgroupSelf: the mounter's own cgroup,
	// which it then leaves for <own>/mounter. Empty: daemons run in the
	// mounter's cgroup and limits are not enforced (said in a warning).
	DaemonCgroup string
	// HostCgroupFS, when set, is the host's cgroup file system (its
	// /sys/fs/cgroup, mounted whole in the mounter's container): the
	// daemons' cgroups are then laid out below its roots, outside the
	// mounter's container's (internal/daemon/cgroup SetupOutside), so
	// that a restart or rollout of the mounter leaves them running; it
	// takes the place of DaemonCgroup. Where that cannot be set up the
	// mounter falls back to DaemonCgroup and says that a stop of its
	// container kills the daemons.
	HostCgroupFS string
	// Spawner starts FUSE daemons; nil: daemon.LocalSpawner.
	Spawner daemon.Spawner
	// RemoveMountPoint: see Executor.
	RemoveMountPoint bool
	// AllowPropagation: see Executor.
	AllowPropagation bool
	// Attributed makes the node act only on what it can attribute
	// (attribution_linux.go): it enters a consumer's namespace only when
	// the container runtime or an admin named it (Local.Attribute), and
	// unmounts only what it recorded mounting or what is of a source it
	// set up. mountplan-sidecar serve sets it: its socket's caller is the
	// plugin, whose word is not enough. Records are kept either way.
	Attributed bool
	// Observe makes a node that only reads the records of the mounter
	// that set the devices up (the one-shot mount command beside it): it
	// holds no device, takes nothing back and writes nothing.
	Observe bool
	// MaxLoops bounds the loop devices the mounter holds at once (AttachLoop
	// past it is ResourceExhausted); 0: DefaultMaxLoops.
	MaxLoops int
	// MaxNBD bounds the NBD devices the mounter has connected at once
	// (ConnectNBD past it is ResourceExhausted); 0: the nbd module's
	// nbds_max, which over netlink is no bound of the kernel's own.
	MaxNBD int
	// ChainTmpfsSize is the size= of a chain's tmpfs upper layer in bytes
	// (a chain request carries no size; a volume that wants more asks for a
	// scratch device with upperSize); 0: DefaultChainTmpfsSize.
	ChainTmpfsSize int64
}

// Defaults of the mounter's bounds (Options).
const (
	DefaultMaxLoops       = 1024
	DefaultChainTmpfsSize = 1 << 30
)

// DefaultRecordsDir is where a mounter keeps its records when not told:
// beside the state dir (<state-dir>-mounter), out of the plugin's reach,
// for the serving mounter, the one-shot commands that read its records
// and a plugin that runs its own alike.
func DefaultRecordsDir(stateDir string) string { return filepath.Clean(stateDir) + "-mounter" }
