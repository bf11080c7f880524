package fuseprofile

import (
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/internal/daemon"
)

// FdMountPoint is where a daemon in fd mode finds its mount: the
// /dev/fuse descriptor the mounter hands it as its fd 3 (the first after
// standard input, output and error), which libfuse >= 3.3 takes in place
// of a mount point.
const FdMountPoint = "/dev/fd/3"

// FdModeUser is the user a daemon in fd mode runs as when its profile has
// no runAs: nobody, which owns no file a daemon could reach.
var FdModeUser = daemon.User{UID: 65534, GID: 65534}

// fdFlagOptions are the mount options a profile may add to an fd-mode
// mount without a value; max_read takes a number. Everything else is the
// mounter's to set (fd, rootmode, user_id, group_id, subtype, nosuid,
// nodev, ro) or never set (suid, dev, blksize of a block device).
var (
	fdFlagOptions = []string{"allow_other", "default_permissions", "noexec", "noatime", "nodiratime", "relatime", "strictatime", "nosymfollow"}
	fdMounterKeys = []string{"fd", "rootmode", "user_id", "group_id", "subtype", "fsname", "source", "nosuid", "nodev"}
	fdMaxRead     = regexp.MustCompile(`^max_read=[1-9][0-9]{0,9}$`)
	// fuseSubtype is what a FUSE mount's type may carry after "fuse.".
	fuseSubtype = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)
)

// DaemonUser is the user p's daemons run as: RunAs, or in fd mode
// FdModeUser when it has none; nil: root.
func (p *Profile) DaemonUser() *daemon.User {
	if p.RunAs == nil && p.FdMount {
		u := FdModeUser
		return &u
	}
	return p.RunAs
}

// FuseSubtype is the subtype of the FUSE mount the mounter makes for p in
// fd mode (its type is fuse.<subtype>): the binary's name, as libfuse
// names the mounts its daemons make themselves.
func (p *Profile) FuseSubtype() string { return filepath.Base(p.Binary) }

// FuseMountOptions are the options of the FUSE mount the mounter makes for
// a daemon of p running as user in fd mode, but for fd=N (the mounter's
// own descriptor number): the ones it always sets, then p's MountOptions.
// A read-only volume's mount is ro whatever the daemon does.
func (p *Profile) FuseMountOptions(readOnly bool, user daemon.User) []string {
	opts := []string{"nosuid", "nodev"}
	if readOnly {
		opts = append(opts, "ro")
	}
	opts = append(opts, "rootmode=40000", fmt.Sprintf("user_id=%d", user.UID), fmt.Sprintf("group_id=%d", user.GID),
		"subtype="+p.FuseSubtype())
	return append(opts, p.MountOptions...)
}

// validateFdMount checks what fd mode asks of a profile: an unprivileged
// daemon (no capability, no root user or group), a binary whose name can
// be the mount's subtype, and mount options the mounter may set for it.
func (p *Profile) validateFdMount() error {
	if !p.FdMount {
		if len(p.MountOptions) > 0 {
			return invalidf("mountOptions are the options of the mount the mounter makes in fd mode: they need fdMount")
		}
		return nil
	}
	if len(p.Capabilities) > 0 {
		return invalidf("fdMount: the daemon only serves the mount the mounter made and holds no capability; remove capabilities")
	}
	if p.RunAs != nil && (p.RunAs.UID == 0 || p.RunAs.GID == 0) {
		return invalidf("fdMount: the daemon runs unprivileged; runAs must not be root (uid or gid 0)")
	}
	if sub := p.FuseSubtype(); !fuseSubtype.MatchString(sub) {
		return invalidf("fdMount: the binary's name %q cannot be the mount's subtype (letters, digits, '.', '_', '-')", sub)
	}
	seen := map[string]bool{}
	for i, o := range p.MountOptions {
		if err := checkFdOption(o); err != nil {
			return fmt.Errorf("mountOptions[%d]: %w", i, err)
		}
		if seen[o] {
			return invalidf("mountOptions[%d]: %q is given twice", i, o)
		}
		seen[o] = true
	}
	return nil
}

func checkFdOption(o string) error {
	key, _, _ := strings.Cut(o, "=")
	switch {
	case slices.Contains(fdFlagOptions, o):
		return nil
	case key == "max_read":
		if !fdMaxRead.MatchString(o) {
			return invalidf("max_read takes a number of bytes (max_read=131072), not %q", o)
		}
		return nil
	case slices.Contains(fdMounterKeys, key):
		return invalidf("%q is set by the mounter", key)
	case key == "ro" || key == "rw":
		return invalidf("%q: the mount is read-only when the volume is (readOnlyArgs are the daemon's)", key)
	}
	return invalidf("%q is not one of %s or max_read=N", o, strings.Join(fdFlagOptions, ", "))
}
