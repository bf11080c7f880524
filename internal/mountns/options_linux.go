package mountns

import (
	"bytes"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
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
		if plan.IsContext(opt) {
			label, err := contextOption(m, opt, bind)
			if err != nil {
				return o, err
			}
			// fsconfig takes the label bare: the quotes only keep its
			// commas apart in a comma-separated mount string.
			o.data = append(o.data, plan.ContextKey+"="+label)
			continue
		}
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

// CheckOptions checks m's options as the mounter would before making m
// (a bind given a filesystem option, an SELinux label where SELinux is
// off), without mounting: for a plan another process performs (the
// container runtime, NRI mode).
func CheckOptions(m plan.Mount) error {
	_, err := parseOptions(m)
	return err
}

// contextOption checks an SELinux context= option of m, here where the
// mount is made, whoever built the plan: one valid label, on a mount that
// makes a superblock (a bind shows its source's labels and cannot take
// one), on a node whose kernel runs SELinux. Without SELinux the kernel
// hands the option to the filesystem, which answers a bare EINVAL; kubelet
// sends context= only where SELinux is on, so a context elsewhere is a
// misconfigured volume (a PV's mountOptions), refused with its reason
// rather than mounted unlabelled.
func contextOption(m plan.Mount, opt string, bind bool) (string, error) {
	label, _, err := plan.ParseContext(opt)
	if err != nil {
		return "", fmt.Errorf("%s mount of %s: %w", m.Type, m.Source, err)
	}
	if bind {
		return "", errOption(m, opt, "is an SELinux label, which a bind cannot take (the mount it comes from must carry it)")
	}
	if !SELinuxEnabled() {
		return "", fmt.Errorf("%s mount of %s asks for SELinux context %q, but SELinux is not enabled on this node (no selinuxfs in /proc/filesystems): %w",
			m.Type, m.Source, label, errdefs.ErrFailedPrecondition)
	}
	return label, nil
}

// SELinuxEnabled reports whether the running kernel has SELinux enabled:
// the kernel registers selinuxfs only then (a kernel built with SELinux
// but booted without it lists no selinuxfs). /proc/filesystems is the
// kernel's, the same in every container. A variable for tests.
var SELinuxEnabled = func() bool {
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return false
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if f := bytes.Fields(line); len(f) > 0 && string(f[len(f)-1]) == "selinuxfs" {
			return true
		}
	}
	return false
}
