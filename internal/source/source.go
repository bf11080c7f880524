// Package source defines how a kind of volume (loop, nbd, iscsi, fuse) is
// activated at stage time and turned into a mount plan. Each kind lives in
// its own package and is registered with the driver by its type name: a new
// kind is a new package, not a new case in a switch.
//
// The driver owns every volume's record and its lock. A source sees a copy
// of what it needs of a record (Volume) and persists its own part only
// through the Recorder it is handed (a format, its state before a side
// effect) or, for work of its own such as a supervisor restarting a
// daemon, through the Host, which takes the volume's lock. A source never
// opens the journal.
package source

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/pkg/plan"
)

// StageRequest is what NodeStageVolume asks of a source.
type StageRequest struct {
	Block    bool
	ReadOnly bool
	// Secrets from the node-stage secret. They must never reach a command
	// line, an environment another process can read, a log line or an
	// error string.
	Secrets map[string]string
	// FsType to create when the device holds no filesystem yet.
	FsType string
	// MountGroup is kubelet's volume_mount_group (a pod's fsGroup), nil
	// when not given: a source whose files are its own (FileOwner) gives
	// them to it at stage.
	MountGroup *uint32
	// SELinuxContext is the label the stage's mounts carry (kubelet's
	// context= flag), "" for none: a source whose plan binds a mount it
	// makes at stage (a FUSE daemon's, a chain's overlay) labels that
	// mount, since a bind cannot. A device's plan gets it in its mount
	// flags instead.
	SELinuxContext string
	// Record persists the source's part of the record before the side
	// effect it names.
	Record Recorder
}

// Volume is what a source sees of a volume's record: a copy, which the
// source may not change the record through.
type Volume struct {
	ID            string
	Kind          model.Kind
	Type          string // the source kind the record names
	Image         string
	CapacityBytes int64
	FsType        string
	Parameters    map[string]string
	// Format is the filesystem made (or being made) on the volume.
	Format *model.Format
	// Staging says a stage is recorded: under way, done, or being undone.
	Staging bool
	// State is what the source recorded of the stage (its Stage result or
	// a SaveIntent); empty when it recorded nothing yet.
	State json.RawMessage
}

// Recorder writes a source's part of a volume's record, under the lock
// the driver holds for the call.
type Recorder interface {
	// SetFormat records the filesystem on the volume: at once and durably
	// when durable (a format about to run, or just done: what describes
	// the disk survives a machine crash), else with the stage's own final
	// write (a filesystem found, which changes nothing on disk).
	SetFormat(f model.Format, durable bool) error
	// SaveIntent records the source's state before a side effect (a
	// device being connected, a daemon being started), so that an undo
	// after a crash finds what may be half done. It describes runtime
	// state, which a reboot erases too: no fsync.
	SaveIntent(state json.RawMessage) error
}

// PlanRequest is what a publish or prepare asks for.
type PlanRequest struct {
	Block      bool
	ReadOnly   bool
	MountFlags []string
}

// Source activates and deactivates one kind of volume.
type Source interface {
	// NewVolume checks the volume_context of a volume this plugin did not
	// provision (a static PV) and returns what its record holds (Image,
	// FsType, Parameters); the driver makes the record.
	// Everything that could name a binary or a host path is checked here
	// against the admin's config; errors wrap errdefs.ErrInvalidArgument.
	NewVolume(id string, vctx map[string]string) (Volume, error)
	// Stage activates v's device and returns the state to keep in the
	// journal. On error it leaves nothing attached.
	Stage(ctx context.Context, v Volume, req StageRequest) (json.RawMessage, error)
	// Plan returns the mounts that make a staged v appear at a mount point.
	// The plan is concrete: every source and option path is final.
	Plan(v Volume, req PlanRequest) ([]plan.Mount, error)
	// Unstage deactivates v after checking that what it detaches is still
	// v's (device numbers are reused quickly). Idempotent.
	Unstage(ctx context.Context, v Volume) error
	// Adopt re-establishes in-memory handles for a staged v after a plugin
	// restart, repairing what it can. It returns the (possibly updated) state.
	Adopt(ctx context.Context, v Volume) (json.RawMessage, error)
}

// ErrNeedsStage is wrapped by an Adopt that cannot bring a staged volume
// back from its record alone, because a reboot took what only a stage
// request carries (a FUSE daemon's secrets): the driver then stages the
// volume anew with the next NodeStageVolume's request.
var ErrNeedsStage = fmt.Errorf("the volume needs a new stage: %w", errdefs.ErrUnavailable)

// Expander is a Source whose volumes can grow.
type Expander interface {
	// Expand makes the staged v's device and filesystem see its new size
	// (online, wherever v is mounted) and returns the size.
	Expand(ctx context.Context, v Volume) (int64, error)
}

// Health is a source's view of a staged volume.
type Health struct {
	Abnormal bool
	// DataLoss says an abnormal volume's data is lost or will be although
	// the volume still answers (an image removed under its device): CSI's
	// DATA_LOSS, where any other abnormal volume is INACCESSIBLE.
	DataLoss bool
	// Reason is CamelCase, for machines (DeviceGone, DaemonDown, ...).
	Reason  string
	Message string
}

// HealthChecker is a Source that can tell whether a staged volume works.
// Check must not block on a dead mount or daemon: it answers from probes
// with timeouts.
type HealthChecker interface {
	Health(ctx context.Context, v Volume) Health
}

// Statter is a Source that answers NodeGetVolumeStats itself, for volumes
// where a plain statfs could hang (a FUSE mount whose daemon stopped
// answering).
type Statter interface {
	Stats(ctx context.Context, v Volume, path string) (fsutil.Usage, error)
}

// Provisioner is a Source whose volumes the plugin makes itself: an image
// file under the state dir for a volume CreateVolume provisions (the
// StorageClass parameter type names the source) or an inline volume (its
// attribute type), which ControllerExpandVolume grows and DeleteVolume
// removes.
type Provisioner interface {
	Source
	// ImagePath is where the image of volume id of kind lives.
	ImagePath(kind model.Kind, id string) string
	// CreateImage makes a sparse image of size bytes at path, with an
	// fsType filesystem on it when fsType is not empty; it appears under
	// its name whole or not at all. made is false when an image was there
	// already and was left as it is.
	CreateImage(ctx context.Context, path string, size int64, fsType string) (made bool, err error)
	// GrowImage extends the image at path to size; it never shrinks one.
	GrowImage(path string, size int64) error
	// RemoveImage deletes the image at path; a missing one is no error.
	RemoveImage(path string) error
	// RemoveDetachedImage deletes the image at path unless a device still
	// reads it, whoever attached it (errdefs.ErrFailedPrecondition).
	RemoveDetachedImage(ctx context.Context, path string) error
	// TempImages lists, by volume ID, the temp files of image creations
	// a crash interrupted. Only a holder of the volume's lock may remove
	// them.
	TempImages() (map[string][]string, error)
}

// Snapshotter is a Provisioner whose images can be copied as one point in
// time: by CreateSnapshot, and by CreateVolume from a snapshot or from
// another volume. The driver keeps every snapshot with the one Snapshotter
// it has.
type Snapshotter interface {
	Provisioner
	// SnapshotImagePath is where snapshot id's image lives.
	SnapshotImagePath(id string) string
	// SnapshotImages lists the snapshot images by ID, and the temp files
	// of copies a crash interrupted. Only a holder of the snapshot's lock
	// may remove them.
	SnapshotImages() (images map[string]string, temps map[string][]string, err error)
	// Freeze freezes the filesystem of the staged v, which its consumers
	// may be writing, so that its image can be copied as one point in
	// time; thaw undoes it. A filesystem that cannot be frozen is
	// errdefs.ErrFailedPrecondition.
	Freeze(ctx context.Context, v Volume) (thaw func() error, err error)
	// Thaw thaws the staged v's filesystem if a copy interrupted by a
	// crash left it frozen.
	Thaw(ctx context.Context, v Volume) error
	// RecoverCopy makes the filesystem in image, a copy, clean (a log
	// left dirty replayed).
	RecoverCopy(ctx context.Context, image string) error
	// GrowUnmounted grows the filesystem of v, a copy made bigger than its
	// source, at its first stage, before anything mounts it.
	GrowUnmounted(ctx context.Context, v Volume) error
}

// Keeper is a Source whose devices the mounter keeps across restarts of
// the plugin. After a reconcile, Keep gets the volumes of the source that
// have a stage recorded, and has the mounter let go of the devices it
// attached before since that none of them holds (a stage a crash
// interrupted before it recorded its device; a volume whose record is
// gone).
type Keeper interface {
	Keep(ctx context.Context, staged []Volume, since time.Time) error
}

// Forgetter is a Source whose stage leaves something on disk that a
// reboot does not end (an overlay's scratch image and directories, a
// session record and the node record it names). Forget removes it for a
// stage of an ended boot, v.State being that boot's, without detaching,
// disconnecting or stopping anything by what the state names: the reboot
// ended every device, session and daemon of it, and a device number or
// session ID it recorded may be someone else's now. Idempotent. A source
// without one left nothing that outlives a boot (NBD), or has its own
// sweep of it (FUSE).
type Forgetter interface {
	Forget(ctx context.Context, v Volume) error
}

// FileOwner is a Source whose volumes' files have owners of the source's
// own (a FUSE daemon serves them as its remote or profile says): kubelet's
// fsGroup (volume_mount_group) is not applied to them at publish; the
// source gets it at stage (StageRequest.MountGroup) instead.
type FileOwner interface {
	OwnsFiles()
}

// Runner is a Source with work of its own for as long as the plugin runs
// (the FUSE source's sweep of orphans, every interval).
type Runner interface {
	Run(ctx context.Context, interval time.Duration)
}

// Host is what the driver offers a source that acts on its own, such as a
// supervisor that restarts a dead daemon.
type Host interface {
	// Reattach heals the volume after its backing mount was restored (a
	// restarted FUSE daemon): every mount of heal.Dead's connections, in
	// every mount namespace of the node, is replaced in place with the new
	// mount at heal.Source, then the plan is performed again at each
	// recorded consumer and publish that lacks it. The result's Left lists
	// the mounts of dead connections still in place. It takes the
	// volume's lock, waiting for it.
	Reattach(ctx context.Context, volumeID string, heal plan.Heal) (plan.HealResult, error)
	// WithVolume runs fn holding the volume's lock, waiting for it like
	// any background work (bounded by ctx), with the volume as its record
	// stands and a Recorder for the source's state. found is false when
	// there is no record (fn then gets only the ID and a nil Recorder).
	WithVolume(ctx context.Context, volumeID, op string, fn func(v Volume, found bool, rec Recorder) error) error
	// WithShared runs fn holding the lock of a record the source keeps
	// about something several volumes share (kind "iscsi-session", key a
	// session's), waiting for it (bounded by ctx). fn gets the record
	// (nil: none) and save, which writes it durably (nil: deletes it)
	// before the side effect it describes.
	WithShared(ctx context.Context, kind, key, op string, fn func(data []byte, save func([]byte) error) error) error
	// SharedKeys lists the keys of kind's records.
	SharedKeys(kind string) ([]string, error)
}

// HostUser is a Source that wants the Host; the driver hands it over when
// it is created.
type HostUser interface {
	SetHost(Host)
}

// ReservedPrefix starts the volume attributes that kubelet and
// external-provisioner add (pod info, PVC name, ephemeral); every source
// accepts and ignores them.
const ReservedPrefix = "csi.storage.k8s.io/"

// DecodeState reads the state a source recorded of v's stage. A volume
// without one is not staged: an error wrapping
// errdefs.ErrFailedPrecondition. State that does not decode into T is
// corrupt: an error naming the volume.
func DecodeState[T any](v Volume) (T, error) {
	var st T
	if len(v.State) == 0 {
		return st, fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	if err := json.Unmarshal(v.State, &st); err != nil {
		return st, fmt.Errorf("volume %s: corrupt %T: %w", v.ID, st, err)
	}
	return st, nil
}

// SaveState records st (marshalled) through rec before a side effect; a
// nil rec (a test without a driver) records nothing.
func SaveState(rec Recorder, st any) error {
	if rec == nil {
		return nil
	}
	raw, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return rec.SaveIntent(raw)
}

// Description is what a staged volume's state names, for an operator (the
// listing of what is mounted where). Every field may be empty.
type Description struct {
	// Source says what the volume is made of, in the source kind's terms:
	// "image /path", "nbd host:port export x", "iscsi iqn... lun 0",
	// "fuse profile p".
	Source string
	Device string
	// DaemonPID is the process serving the volume (a FUSE daemon), as
	// recorded; 0 when none.
	DaemonPID int
}

// Describer is a Source that can describe a volume from its record and
// state alone: no I/O, no mounter call.
type Describer interface {
	Describe(v Volume) Description
}
