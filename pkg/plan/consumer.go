package plan

import (
	"fmt"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Namespace identifies a mount namespace. The inode (of /proc/PID/ns/mnt)
// is what the API has always carried, but the kernel hands it out again as
// soon as the namespace dies (the next `unshare -m` often gets the same
// number). The 64-bit namespace ID (NS_GET_MNTNS_ID, Linux 6.9+) is never
// reused, so it is what tells a namespace apart from a later one with the
// same inode. ID is 0 where the kernel lacks it; the zero Namespace is
// "unknown".
type Namespace struct {
	Inode uint64 `json:"nsInode"`
	ID    uint64 `json:"nsId,omitempty"`
}

// Matches reports whether got, the identity of a namespace at hand, is the
// namespace n names. A zero field of n is not checked, so the zero
// Namespace matches any namespace; the ID is compared only when n knows it.
func (n Namespace) Matches(got Namespace) bool {
	return (n.Inode == 0 || got.Inode == n.Inode) && (n.ID == 0 || got.ID == n.ID)
}

func (n Namespace) String() string {
	if n.ID == 0 {
		return strconv.FormatUint(n.Inode, 10)
	}
	return fmt.Sprintf("%d (id %d)", n.Inode, n.ID)
}

// Consumer says where a plan is performed: in the mount namespace of a
// process, at a mount point as that namespace sees it. The same value is
// recorded by the plugin (a claim), sent on the wire (ToProto/FromProto of
// api.Consumer) and handed to the mounter.
type Consumer struct {
	// PID of a process in the target mount namespace, as the host's PID
	// namespace sees it; 0 means the mounter's own mount namespace.
	PID int `json:"pid"`
	// MountPoint is an absolute path as the consumer's namespace sees it.
	MountPoint string `json:"mountPoint"`
	// Namespace, when known, is the namespace PID must still be in: a PID
	// that was reused by a process elsewhere fails. With its ID known, the
	// namespace is entered through any process still in it once PID no
	// longer names it. Embedded so that a recorded consumer's JSON stays
	// flat (pid, mountPoint, nsInode, nsId).
	Namespace
	// ContainerID, when set, is the container runtime's ID of a container
	// that receives the plan through its runtime (the NRI hook): the
	// runtime mounts it, and PID is 0 until its process exists.
	ContainerID string `json:"containerID,omitempty"`
	// SubPath, when set, is a directory of the volume (relative, clean,
	// below its root) that the consumer gets at MountPoint instead of the
	// whole volume: a container's subPath volume mount. Missing
	// directories are made; a symlink on the way is refused. Plans of one
	// mount only.
	SubPath string `json:"subPath,omitempty"`
}

func (c Consumer) String() string {
	s := fmt.Sprintf("pid %d at %s", c.PID, c.MountPoint)
	if c.ContainerID != "" {
		s = fmt.Sprintf("container %s at %s", c.ContainerID, c.MountPoint)
	}
	if c.Namespace != (Namespace{}) {
		s += " (mount namespace " + c.Namespace.String() + ")"
	}
	return s
}

// Validate accepts a PID of 0 or more and a clean absolute mount point
// other than "/" (a volume never replaces a namespace's root). Errors wrap
// errdefs.ErrInvalidArgument. Which consumers a mounter serves is its
// policy's business, not this check's.
func (c Consumer) Validate() error {
	if c.PID < 0 {
		return fmt.Errorf("consumer pid %d: %w", c.PID, errdefs.ErrInvalidArgument)
	}
	if !IsCleanAbs(c.MountPoint) || c.MountPoint == "/" {
		return fmt.Errorf("consumer mount point %q must be a clean absolute path other than /: %w", c.MountPoint, errdefs.ErrInvalidArgument)
	}
	if c.SubPath != "" && (c.SubPath == "." || !filepath.IsLocal(c.SubPath) || path.Clean(c.SubPath) != c.SubPath || len(c.SubPath) > 4096) {
		return fmt.Errorf("consumer subPath %q must be a clean relative path below the volume's root: %w", c.SubPath, errdefs.ErrInvalidArgument)
	}
	if len(c.ContainerID) > 128 || strings.ContainsFunc(c.ContainerID, func(r rune) bool { return !isIDRune(r) }) {
		return fmt.Errorf("consumer container id %q: %w", c.ContainerID, errdefs.ErrInvalidArgument)
	}
	return nil
}

// isIDRune accepts what runtimes put in container IDs (containerd's are
// 64 hex digits; others use names).
func isIDRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.'
}
