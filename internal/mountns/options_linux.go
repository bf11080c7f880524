package mountns

import (
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/plan"
)

// options is a descriptor's option list sorted into what each syscall takes.
type options struct {
	attr     uint64   // MOUNT_ATTR_* for fsmount or mount_setattr
	atimeSet bool     // an atime mode was chosen (it must be cleared first)
	sbFlags  []string // superblock flags for fsconfig (ro, sync, dirsync, lazytime)
	data     []string // filesystem data options, "key" or "key=value"
}

func parseOptions(m plan.Mount) (options, error) {
	var o options
	bind := m.Type == plan.TypeBind
	for _, opt := range m.Options {
		if !plan.IsFlag(opt) {
			if bind {
				return o, errOption(m, opt, "is a filesystem option, which a bind cannot take")
			}
			o.data = append(o.data, opt)
			continue
		}
		if err := o.addFlag(m, opt, bind); err != nil {
			return o, err
		}
	}
	return o, nil
}

func (o *options) addFlag(m plan.Mount, opt string, bind bool) error {
	if attr, ok := mountAttrs[opt]; ok {
		o.attr |= attr
		return nil
	}
	if mode, ok := atimeModes[opt]; ok {
		o.attr = o.attr&^unix.MOUNT_ATTR__ATIME | mode
		o.atimeSet = true
		return nil
	}
	switch opt {
	case "ro":
		o.attr |= unix.MOUNT_ATTR_RDONLY
		// On a read-only device (an erofs image, a write-protected disk)
		// the filesystem itself must be opened read-only too. Elsewhere
		// "ro" stays per mount: a read-only superblock would refuse to
		// share the device with a writable mount of it ("would change RO
		// state"), and one consumer's ro must not bind another's.
		if strings.HasPrefix(m.Source, "/dev/") && !bind && ReadOnlyDevice(m.Source) {
			o.sbFlags = append(o.sbFlags, "ro")
		}
	case "sync", "dirsync", "lazytime":
		if bind {
			return errOption(m, opt, "is a superblock flag, which a bind cannot change")
		}
		o.sbFlags = append(o.sbFlags, opt)
	case "rec":
		// A recursive clone takes every mount below the source along,
		// mounts nobody checked (plan.Policy refuses it as well).
		return errOption(m, opt, "(a recursive bind) is never performed")
	}
	// rw, suid, dev, exec, atime, diratime, async: the defaults of a new mount.
	return nil
}

// mountAttrs maps the per-mount flags to MOUNT_ATTR_* bits.
var mountAttrs = map[string]uint64{
	"nosuid":      unix.MOUNT_ATTR_NOSUID,
	"nodev":       unix.MOUNT_ATTR_NODEV,
	"noexec":      unix.MOUNT_ATTR_NOEXEC,
	"nodiratime":  unix.MOUNT_ATTR_NODIRATIME,
	"nosymfollow": unix.MOUNT_ATTR_NOSYMFOLLOW,
}

// atimeModes maps the atime flags, which are one field of three values
// rather than independent bits.
var atimeModes = map[string]uint64{
	"relatime":    unix.MOUNT_ATTR_RELATIME,
	"noatime":     unix.MOUNT_ATTR_NOATIME,
	"strictatime": unix.MOUNT_ATTR_STRICTATIME,
}

// ReadOnlyDevice reports whether the block device at p is read-only
// (BLKROGET). Anything it cannot tell counts as writable: the mount then
// fails with the kernel's own message if it was not.
func ReadOnlyDevice(p string) bool {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	ro, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	return err == nil && ro != 0
}
