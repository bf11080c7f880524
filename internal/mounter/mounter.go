// Package mounter is the node's privileged part: everything mountplan does
// that needs CAP_SYS_ADMIN, the host's devices or the host's PID namespace
// happens here, on typed and narrow requests, each checked against what the
// mounter sees itself. The plugin decides and parses; the mounter acts.
//
//   - Plans: Executor attaches a plan's mounts at a consumer's mount point
//     inside the consumer's mount namespace and removes them again.
//   - Devices: Local attaches loop devices, connects NBD exports, logs in to
//     iSCSI targets, and runs filesystem tools on them; it keeps records of
//     what it set up (keyed by device number and backing inode, surviving
//     its restarts), and a plan may only name a device or a mount that is
//     in them.
//   - FUSE daemons: Local starts each from the admin's profile, mounts its
//     secrets, watches and stops it.
//
// Node is every interface below; Local implements it in process,
// internal/mounter/service serves a Local on a socket (mountplan-sidecar
// serve), and its client implements Node for the plugin.
package mounter

import (
	"context"
	"os"
	"time"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Interface performs and undoes plans. Node (through Executor) and the
// service's client implement it.
type Interface interface {
	// Mount performs mounts in order at c. On failure it unmounts what it
	// had attached and returns an error wrapping an errdefs sentinel.
	Mount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error
	// Unmount removes mounts in reverse order at c. Mounts that are already
	// gone are not an error; a namespace that no longer exists is not an
	// error either (the kernel dropped its mounts with it).
	Unmount(ctx context.Context, mounts []plan.Mount, c plan.Consumer) error
}

// Healer replaces, in place and in every mount namespace of the node, the
// mounts of FUSE connections whose daemon died with the volume's new FUSE
// mount (plan.Heal).
type Healer interface {
	// HealFuse returns what it replaced and what is left (with the
	// reason); an error means the request itself was refused or the node's
	// mount tables could not be read.
	HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error)
}

// Device names a block device the mounter set up. Calls that act on a
// device name it by number, which the mounter checks against its records
// before it touches anything; Path is its node in /dev, for messages.
type Device struct {
	Path  string `json:"path"`
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
}

// LoopRequest asks for a loop device over an image file.
type LoopRequest struct {
	// Image is a regular file below one of the mounter's image roots,
	// named without a symlink anywhere below the root.
	Image     string `json:"image"`
	ReadOnly  bool   `json:"readOnly,omitempty"`
	DirectIO  bool   `json:"directIO,omitempty"`
	BlockSize uint32 `json:"blockSize,omitempty"`
}

// Loop is a loop device the mounter attached and holds open.
type Loop struct {
	Device
	Identity loopdev.Identity `json:"identity"`
	// DirectIO and ReadOnly are what the kernel does, read back.
	DirectIO bool `json:"directIO,omitempty"`
	ReadOnly bool `json:"readOnly,omitempty"`
}

// Loops attaches and detaches loop devices. Every device is attached with
// autoclear and held open by the mounter until it is detached: when the
// mounter dies, the kernel clears every device nothing mounts.
type Loops interface {
	AttachLoop(ctx context.Context, req LoopRequest) (Loop, error)
	// AdoptLoop returns the device of identity id if the mounter set it
	// up and it is still bound to the same file; else ErrNotFound.
	AdoptLoop(ctx context.Context, id loopdev.Identity) (Loop, error)
	// DetachLoop detaches id if it is still the device the mounter set
	// up; one that is gone is not an error.
	DetachLoop(ctx context.Context, id loopdev.Identity) error
	// ResizeLoop makes the device see its grown image and returns its size.
	ResizeLoop(ctx context.Context, id loopdev.Identity) (int64, error)
	// KeepLoops lets go of every device attached before attachedBefore
	// that is not in ids (the plugin's view of what is staged, after its
	// startup reconcile): once nothing mounts them, the kernel clears
	// them. A stage in flight attached its device later and is spared.
	KeepLoops(ctx context.Context, ids []loopdev.Identity, attachedBefore time.Time) (released int, err error)
}

// Filesystems runs filesystem tools on a device the mounter set up.
type Filesystems interface {
	// Detect returns the filesystem on dev, "" when it holds none.
	Detect(ctx context.Context, dev Device) (string, error)
	// Format makes an fsType filesystem on dev, overwriting what is there.
	Format(ctx context.Context, dev Device, fsType string) error
	// GrowFS makes dev's filesystem fill the device. unused says the
	// device is mounted nowhere (a copy being staged): ext4 then grows
	// offline; the mounter checks it is so.
	GrowFS(ctx context.Context, dev Device, fsType string, unused bool) error
	// Freeze freezes dev's filesystem for a consistent copy; Thaw undoes
	// it, also after a crash of either side (a filesystem not frozen is
	// left as it is).
	Freeze(ctx context.Context, dev Device, fsType string) error
	Thaw(ctx context.Context, dev Device, fsType string) error
	// ApplyGroup gives the filesystem a plan mounts to group gid, as
	// kubelet does with an fsGroup, through a private mount of the plan.
	ApplyGroup(ctx context.Context, mounts []plan.Mount, gid uint32) error
	// ReplayLog mounts the xfs in image, a copy of a frozen filesystem
	// made with sectors of blockSize, once privately so that its log is
	// replayed.
	ReplayLog(ctx context.Context, image string, blockSize uint32) error
}

// ChainRequest asks for a volume's overlay chain under the state dir: the
// read-only image's filesystem, a writable upper layer (tmpfs, or a
// scratch device's ext4) and the overlay of both.
type ChainRequest struct {
	VolumeID  string `json:"volumeID"`
	Lower     Device `json:"lower"`
	LowerType string `json:"lowerType"`
	// Upper is a scratch device holding an ext4 filesystem; nil: tmpfs.
	Upper *Device `json:"upper,omitempty"`
	// SELinuxContext labels the lower layer's mount and the overlay (the
	// two a plan binds), "" for none. The mounter checks it as it mounts.
	SELinuxContext string `json:"seLinuxContext,omitempty"`
}

// Chain is where a volume's chain lives; the plan binds Merged, or Lower
// for a read-only consumer.
type Chain struct {
	Dir    string `json:"dir"`
	Lower  string `json:"lower"`
	Upper  string `json:"upper"`
	Merged string `json:"merged"`
}

// Chains builds and tears down overlay chains.
type Chains interface {
	BuildChain(ctx context.Context, req ChainRequest) (Chain, error)
	// TeardownChain unmounts and removes a volume's chain. Idempotent.
	TeardownChain(ctx context.Context, volumeID string) error
}

// Namespaces answers what the plugin, outside the host's PID namespace,
// cannot see, and makes device nodes where kubelet looks.
type Namespaces interface {
	// IdentifyNamespace returns the identity of pid's mount namespace.
	IdentifyNamespace(ctx context.Context, pid int) (plan.Namespace, error)
	// LiveNamespaces reports, for each consumer, whether a process is
	// still in its mount namespace (its own PID, or any other).
	LiveNamespaces(ctx context.Context, cs []plan.Consumer) ([]bool, error)
	// StatFS measures the filesystem at c's mount point inside c's
	// namespace.
	StatFS(ctx context.Context, c plan.Consumer) (fsutil.Usage, error)
	// StatDevice measures the filesystem on dev, a device the mounter
	// set up, through a private mount of it (read-only when readOnly):
	// a volume whose containers have all stopped has no mount left to
	// measure through.
	StatDevice(ctx context.Context, dev Device, readOnly bool) (fsutil.Usage, error)
	// MakeDeviceNode creates a block device node of dev at target, below
	// kubelet's directory; created is false when it was there already.
	MakeDeviceNode(ctx context.Context, target string, dev Device) (created bool, err error)
}

// Target is what the mounter sees at a target path below kubelet's
// directory, a symlink there not followed.
type Target struct {
	// Parent: the directory the path lies in exists (kubelet makes a
	// publish's and keeps it while the pod has the volume).
	Parent bool `json:"parent,omitempty"`
	// Exists: something is at the path.
	Exists bool `json:"exists,omitempty"`
	// Device is the number of the block device node at the path (an NRI
	// block publish), nil when something else or nothing is there.
	Device *Device `json:"device,omitempty"`
	// Mounted: something is mounted at the path, or whether it is could
	// not be told (a dead FUSE mount answers ENOTCONN): unmounting is
	// safer than believing it gone.
	Mounted bool `json:"mounted,omitempty"`
}

// Targets makes, inspects, measures and removes the plugin's target paths
// in kubelet's directory, which the plugin does not see: another pod's
// Secrets and tokens lie in that tree. Every call refuses a path that is
// not strictly below the mounter's own kubelet dir (ErrPermissionDenied)
// and one whose directories, below it, include a symlink or something
// not a directory (ErrInvalidArgument, as a CO's malformed path is); none
// follows a symlink.
type Targets interface {
	// MakeTarget makes sure target p exists (missing parents made 0750,
	// as kubelet does): a directory, or for block an empty file (a device
	// is bound onto it). It reports whether it created it; an existing p
	// of the other kind, or a symlink, is ErrInvalidArgument.
	MakeTarget(ctx context.Context, p string, block bool) (created bool, err error)
	// TargetState reports what is at p; a missing kubelet dir, parent or
	// p is no error.
	TargetState(ctx context.Context, p string) (Target, error)
	// RemoveTarget removes p only while it holds nothing: an empty
	// directory or regular file, or a device node. Anything else stays,
	// and p gone is no error.
	RemoveTarget(ctx context.Context, p string) error
	// StatTarget measures the filesystem mounted at p; nothing mounted
	// there is ErrNotFound.
	StatTarget(ctx context.Context, p string) (fsutil.Usage, error)
}

// DaemonRequest starts one incarnation of a volume's FUSE daemon. It names
// an admin profile and the volume's parameters, never a command or a path:
// the mounter renders the command from its own copy of the profile.
type DaemonRequest struct {
	VolumeID string            `json:"volumeID"`
	Profile  string            `json:"profile"`
	Params   map[string]string `json:"params"`
	ReadOnly bool              `json:"readOnly,omitempty"`
	// MountGroup is the group the volume is staged for (kubelet's
	// volume_mount_group), nil for none: the profile's mountGroupArgs.
	MountGroup *uint32 `json:"mountGroup,omitempty"`
	// Secrets are the node-stage secrets the profile reads from files,
	// by name; written once, on the first start, into a tmpfs. A later
	// start (a restart) reuses them and takes none.
	Secrets    map[string]string `json:"secrets,omitempty"`
	Generation int               `json:"generation"` // 1 at stage, +1 per restart
	// ReadyTimeout bounds the wait for the mount to serve (default 30s,
	// at most 5 minutes).
	ReadyTimeout time.Duration `json:"readyTimeout"`
	// SELinuxContext labels the FUSE mount (context=), "" for none. Only
	// the mounter's own mount (fd mode) can carry it: a daemon that mounts
	// by itself is refused a label rather than mounting without one.
	SELinuxContext string `json:"seLinuxContext,omitempty"`
}

// DaemonInfo is a running daemon and its FUSE connection.
type DaemonInfo struct {
	daemon.Proc
	Conn uint64 `json:"conn"`
	// Command is what was started (paths of secret files, never secrets).
	Command daemon.Command `json:"command"`
	// MountPoint is where the daemon mounts, BindSource the same
	// directory as a plan names it (the state dir as given).
	MountPoint string `json:"mountPoint"`
	BindSource string `json:"bindSource"`
}

// DaemonStatus is what the supervisor asks about a daemon.
type DaemonStatus struct {
	Alive bool `json:"alive"`
	// Waiting counts the requests the daemon has not answered yet.
	Waiting int `json:"waiting"`
	// Reason says why a daemon that is gone died, when the mounter
	// knows (ReasonOOMKilled), and Detail says more.
	Reason string `json:"reason,omitempty"`
	Detail string `json:"detail,omitempty"`
}

// DaemonUsage is what one volume's daemon uses, from its cgroup.
type DaemonUsage struct {
	VolumeID string `json:"volumeID"`
	Profile  string `json:"profile"`
	// Cgroup is the daemon's cgroup; "": none (the figures are zero).
	Cgroup string `json:"cgroup,omitempty"`
	// LimitsEnforced: the profile limits nothing, or its limits are
	// applied to the daemon's cgroup.
	LimitsEnforced bool `json:"limitsEnforced"`
	// MemoryBytes is memory.current (HasMemory false: not accounted),
	// MemoryMaxBytes memory.max (0: no limit).
	MemoryBytes    uint64 `json:"memoryBytes"`
	HasMemory      bool   `json:"hasMemory"`
	MemoryMaxBytes uint64 `json:"memoryMaxBytes"`
	// CPUUsec is the CPU time used (cpu.stat usage_usec).
	CPUUsec uint64 `json:"cpuUsec"`
	// OOMKills counts the OOM kills in the cgroup, every generation of
	// the volume's daemon together.
	OOMKills uint64 `json:"oomKills"`
}

// DaemonUsages reports the daemons' usage (a metrics scrape asks).
type DaemonUsages interface {
	DaemonUsage(ctx context.Context) ([]DaemonUsage, error)
}

// Pinger is a mounter in another process (the sidecar's serve), which may
// stop answering while the plugin runs: Ping asks it for nothing but an
// answer. A mounter in the plugin's own process has nothing to ask.
type Pinger interface {
	Ping(ctx context.Context) error
}

// Daemons runs the FUSE daemons of volumes under <state-dir>/fuse/<id>.
type Daemons interface {
	// StartDaemon makes the volume's directory (and secrets, at the
	// first start), starts the daemon (no_new_privs, the profile's
	// capabilities only) and returns once its FUSE mount serves; on
	// failure it stops it again. A volume whose daemon runs is
	// ErrFailedPrecondition: stop it first.
	StartDaemon(ctx context.Context, req DaemonRequest) (DaemonInfo, error)
	// WaitDaemon returns nil when p, a daemon the mounter started, has
	// exited, or ctx's error; a live process it did not start is
	// ErrNotFound.
	WaitDaemon(ctx context.Context, p daemon.Proc) error
	// DaemonStatus reports on p, a daemon the mounter started, and on
	// its connection conn (0: not asked); a connection that is gone is
	// ErrNotFound.
	DaemonStatus(ctx context.Context, p daemon.Proc, conn uint64) (DaemonStatus, error)
	// StopDaemons aborts the FUSE connections under the volume's
	// directory, stops every daemon the mounter started for it (and
	// those in known that still are the volume's daemons) and lazily
	// unmounts what is left on its mount point. Without teardown (a
	// restart) the daemons get SIGKILL at once and the directory and
	// secrets stay; with teardown they get SIGTERM first, and the
	// secrets and the volume's directory are removed. Idempotent.
	StopDaemons(ctx context.Context, volumeID string, known []daemon.Proc, teardown bool) error
}

// NBDRequest connects an NBD device to a socket the plugin negotiated.
type NBDRequest struct {
	// SizeBytes is the export's size; BlockSize the device's logical
	// block size (a power of two from 512 to the page size; 0: the
	// kernel's default).
	SizeBytes uint64 `json:"sizeBytes"`
	BlockSize uint64 `json:"blockSize"`
	// ServerFlags are the handshake's transmission flags (16 bits; with
	// nbdnl.FlagReadOnly the device is read-only).
	ServerFlags uint64 `json:"serverFlags"`
	// Timeout bounds each request (0: the kernel's 30 s).
	Timeout time.Duration `json:"timeout"`
	// DeadConnTimeout keeps I/O queued this long after the socket breaks,
	// for ReconnectNBD; 0: fail at once. Both at most an hour.
	DeadConnTimeout time.Duration `json:"deadConnTimeout,omitempty"`
	// Backend names the connection (the kernel shows it in
	// /sys/block/nbdN/backend): how both sides tell it is theirs. Only
	// mountplan's own form is accepted (NewNBDBackend), new for every
	// connect.
	Backend string `json:"backend"`
}

// NBD hands connected sockets to the kernel's NBD driver. The plugin
// makes the connection and the whole handshake (TLS included) itself and
// passes the socket, in the transmission phase, as a descriptor; the
// mounter records each device with its backend (surviving its restarts,
// not a reboot), and a plan may name only a device the kernel still
// shows connected with the backend recorded for it.
type NBD interface {
	// ConnectNBD connects a free device (the kernel picks it) to sock
	// and returns it. A backend of another form, one the mounter or the
	// kernel already has, or anything but a connected stream socket is
	// refused.
	ConnectNBD(ctx context.Context, req NBDRequest, sock *os.File) (Device, error)
	// ReconnectNBD gives the device connected with backend a new socket
	// in place of its dead one (the kernel drops it while the old one
	// lives). dev, when not zero, must be that device; a backend the
	// mounter did not connect, or whose device the kernel no longer
	// shows with it, is ErrNotFound.
	ReconnectNBD(ctx context.Context, dev Device, backend string, sock *os.File) error
	// DisconnectNBD disconnects the device connected with backend (dev,
	// when not zero, must be it; zero: an undo that never learnt the
	// device) and forgets it. A backend the mounter has no record of is
	// not an error, and nothing is touched.
	DisconnectNBD(ctx context.Context, dev Device, backend string) error
}

// CHAP are the credentials of an iSCSI login. Every field is at most 255
// bytes without a line break or NUL (they go into a node record file);
// empty fields: no authentication. String hides them.
type CHAP struct {
	User       string `json:"user,omitempty"`
	Password   string `json:"password,omitempty"`
	UserIn     string `json:"userIn,omitempty"`
	PasswordIn string `json:"passwordIn,omitempty"`
}

func (CHAP) String() string   { return "CHAP{redacted}" }
func (CHAP) GoString() string { return "CHAP{redacted}" }

// ISCSILogin logs in to one target portal, or joins the session the
// mounter made there.
type ISCSILogin struct {
	IQN    string `json:"iqn"`
	Portal string `json:"portal"` // host:port, one iscsi.allowedPortals allows
	TPGT   int    `json:"tpgt"`
	// LUN is scanned for on the session once it is there, so that a LUN
	// the target gained after the login shows too.
	LUN int `json:"lun"`
	// CHAP are the stage's credentials. A new session: they are written
	// into the node record (mode 0600), then iscsiadm logs in from it.
	// The session the mounter made to this target and portal: joined only
	// with the credentials it was made with (the mounter keeps a salted
	// hash of them, never them). Nil: a staged volume's re-login (its
	// session was lost), from the node record the mounter wrote, so that
	// the secrets never pass through the plugin again; refused when the
	// mounter has no record of writing it.
	CHAP *CHAP `json:"chap,omitempty"`
}

// ISCSISession is the session of a LoginISCSI.
type ISCSISession struct {
	SID int `json:"sid"`
	// Joined: the session was there already (the mounter made it, with
	// the same credentials); this call logged nothing in.
	Joined bool `json:"joined,omitempty"`
}

// ISCSILogout ends the session the mounter made to a target and portal.
type ISCSILogout struct {
	IQN    string `json:"iqn"`
	Portal string `json:"portal"`
	// SID is the session the caller knows of (0: none yet); the mounter
	// ends the one it recorded, and says so when they differ.
	SID int `json:"sid,omitempty"`
}

// ISCSI logs in to and out of iSCSI targets. The mounter keeps a record
// per session it logged in (target, portal, SID, boot, a salted hash of
// the credentials); a plan may name only a disk of such a session.
type ISCSI interface {
	// LoginISCSI logs in, or joins the session to the same target and
	// portal that the mounter made with the same credentials. Other
	// credentials than the recorded ones are ErrPermissionDenied; a
	// session to the target and portal that the mounter did not make is
	// never joined nor logged out: ErrFailedPrecondition. A login that
	// fails leaves no session, node record or record it made.
	LoginISCSI(ctx context.Context, l ISCSILogin) (ISCSISession, error)
	// LogoutISCSI ends the recorded session (if the kernel still shows
	// it), deletes the node record if the mounter created it, and forgets
	// the session. Nothing recorded: nothing to do, no error.
	LogoutISCSI(ctx context.Context, l ISCSILogout) error
}

// Node is everything the plugin asks of the mounter.
type Node interface {
	Interface
	Healer
	Loops
	Filesystems
	Chains
	Namespaces
	Targets
	Daemons
	NBD
	ISCSI
}
