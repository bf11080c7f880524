package driver

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The access modes a node-local volume can honour. SINGLE_NODE_WRITER stays
// for COs that predate SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod) and
// SINGLE_NODE_MULTI_WRITER (ReadWriteOnce), as CSI demands of a plugin with
// the SINGLE_NODE_MULTI_WRITER capability.
var supportedModes = []csi.VolumeCapability_AccessMode_Mode{
	csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
}

// modeNames lists supportedModes for an error.
func modeNames() string {
	names := make([]string, len(supportedModes))
	for i, m := range supportedModes {
		names[i] = m.String()
	}
	return strings.Join(names, ", ")
}

func invalid(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, errdefs.ErrInvalidArgument)...)
}

func requireField(name, value string) error {
	if value == "" {
		return invalid("%s is required", name)
	}
	return nil
}

// requireVolumeID checks presence first (CSI wants InvalidArgument for a
// missing ID before any lookup) and then that the ID is safe as a file name.
func requireVolumeID(id string) error {
	if err := requireField("volume_id", id); err != nil {
		return err
	}
	return model.ValidID(id)
}

// requirePath checks a CO-supplied path: absolute and clean.
func requirePath(name, p string) error {
	if err := requireField(name, p); err != nil {
		return err
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || strings.ContainsRune(p, 0) {
		return invalid("%s %q must be a clean absolute path", name, p)
	}
	return nil
}

// capability is a validated volume capability.
type capability struct {
	block    bool
	readOnly bool // the access mode allows no writer
	// singleWriter: SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod), one
	// publish on the node at a time (checkPublishes).
	singleWriter bool
	fsType       string
	mountFlags   []string
	// seLinuxContext is the label of the mount flags' context= option
	// (SELinuxMount), "" for none.
	seLinuxContext string
	nri            bool // the volume's attributes ask for NRI mode (publish only)
	// pod is who kubelet publishes for (publish only; podInfoOnMount).
	pod model.Pod
	// mountGroup is volume_mount_group (kubelet's fsGroup), when set.
	mountGroup    uint32
	mountGroupSet bool
	// target is what the mounter saw at the publish's target_path when
	// the request was checked (publish only): the publish acts on it
	// under the volume's lock instead of asking again, a round trip to
	// the mounter less. Nil: not asked yet.
	target *mounter.Target
}

func checkCapability(c *csi.VolumeCapability) (capability, error) {
	if c == nil {
		return capability{}, invalid("volume_capability is required")
	}
	mode := c.GetAccessMode().GetMode()
	if c.GetAccessMode() == nil || mode == csi.VolumeCapability_AccessMode_UNKNOWN {
		return capability{}, invalid("volume_capability.access_mode is required")
	}
	if !slices.Contains(supportedModes, mode) {
		return capability{}, invalid("access mode %s is not supported by node-local volumes: use one of %s (a claim's ReadWriteOnce or ReadWriteOncePod)", mode, modeNames())
	}
	out := capability{readOnly: mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		singleWriter: mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER}
	switch {
	case c.GetBlock() != nil:
		out.block = true
	case c.GetMount() != nil:
		out.fsType = c.GetMount().GetFsType()
		out.mountFlags = c.GetMount().GetMountFlags()
		var err error
		if out.mountGroup, out.mountGroupSet, err = parseMountGroup(c.GetMount().GetVolumeMountGroup()); err != nil {
			return capability{}, err
		}
		// A context= flag is a label whose quoted categories hold
		// commas: checked on its own, and nothing else may ride in it.
		if out.seLinuxContext, err = plan.ContextOf(out.mountFlags); err != nil {
			return capability{}, err
		}
		for _, f := range out.mountFlags {
			if err := plan.CheckLabelOption(f); err != nil {
				return capability{}, err
			}
			if plan.IsContext(f) {
				continue
			}
			if f == "" || strings.ContainsAny(f, ",\x00") || strings.Contains(f, "/") {
				return capability{}, invalid("mount flag %q is not allowed", f)
			}
		}
		if out.fsType != "" && !slices.Contains(plan.DefaultTypes, out.fsType) {
			return capability{}, invalid("fs_type %q is not supported: use one of %s, or none for the volume's default (the StorageClass's csi.storage.k8s.io/fstype, else the config's defaultFsType)",
				out.fsType, strings.Join(plan.DefaultTypes, ", "))
		}
	default:
		return capability{}, invalid("volume_capability needs an access type (mount or block)")
	}
	return out, nil
}

// parseMountGroup reads volume_mount_group: a numeric group ID, or empty.
func parseMountGroup(s string) (gid uint32, set bool, err error) {
	if s == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false, invalid("volume_mount_group %q must be a numeric group ID", s)
	}
	return uint32(n), true, nil
}

func checkCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return invalid("volume_capabilities are required")
	}
	for _, c := range caps {
		if _, err := checkCapability(c); err != nil {
			return err
		}
	}
	return nil
}

func accessName(block bool) string {
	if block {
		return "block"
	}
	return "mount"
}

// checkStagingPath refuses a request whose staging path is not the one v
// was staged at: a publish or prepare may only name the volume kubelet
// staged there.
func checkStagingPath(v *model.Volume, stagingPath string) error {
	if v.Stage != nil && v.Stage.StagingPath != stagingPath {
		return invalid("volume %s is staged at %s, not at %s", v.ID, v.Stage.StagingPath, stagingPath)
	}
	return nil
}

// checkPublishes applies CSI's rule for another NodePublishVolume of v on
// this node (the spec's table for a plugin with the SINGLE_NODE_MULTI_WRITER
// capability), before anything is recorded or mounted. A volume published
// SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod) stands at one target at a
// time: a publish at another target is FailedPrecondition, whichever of the
// two asked for a single writer. SINGLE_NODE_MULTI_WRITER, and
// SINGLE_NODE_WRITER as before (kept for older COs, as csi-driver-host-path
// does), allow several targets. At the same target, the other of "single
// writer or not" is AlreadyExists, as another readonly flag is. Only
// kubelet's publishes count (NRI ones included: their containers are one
// pod's); a NodePrepareVolume consumer is the prepare caller's business.
func checkPublishes(v *model.Volume, target string, c capability) error {
	for _, p := range v.Publishes {
		switch {
		case p.TargetPath == target && p.SingleWriter != c.singleWriter:
			return fmt.Errorf("volume %s is already published at %s with single writer %t: %w", v.ID, target, p.SingleWriter, errdefs.ErrAlreadyExists)
		case p.TargetPath == target:
		case p.SingleWriter:
			return fmt.Errorf("volume %s is published at %s for a single writer (SINGLE_NODE_SINGLE_WRITER); unpublish it there first: %w",
				v.ID, p.TargetPath, errdefs.ErrFailedPrecondition)
		case c.singleWriter:
			return fmt.Errorf("volume %s is asked for a single writer (SINGLE_NODE_SINGLE_WRITER) but is published at %s too: %w",
				v.ID, p.TargetPath, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}
