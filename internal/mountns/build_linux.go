package mountns

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Supported reports whether this kernel and process can use the new mount
// API: fsopen/fsmount/move_mount (Linux 5.2) and mount_setattr (Linux 5.12).
// The error wraps errdefs.ErrFailedPrecondition.
func Supported() error {
	fd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	switch {
	case errors.Is(err, unix.ENOSYS):
		return errNoNewAPI("fsopen")
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("fsopen: %w: the mounter needs CAP_SYS_ADMIN: %w", err, errdefs.ErrFailedPrecondition)
	case err != nil:
		return fmt.Errorf("fsopen tmpfs: %w", err)
	}
	unix.Close(fd)
	// Unknown flags make mount_setattr fail with EINVAL before it looks at
	// anything else, so this probe has no side effect.
	if err := unix.MountSetattr(-1, "", 1<<31, &unix.MountAttr{}); errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("mount_setattr: kernel lacks it (Linux 5.12+): %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}

// Build creates m as a detached mount in the caller's mount namespace and
// returns its fd (close-on-exec). Closing the fd without attaching it drops
// the mount. Source and path options resolve in the caller's namespace.
func Build(m plan.Mount) (*os.File, error) {
	return BuildFrom(m, nil)
}

// BuildFrom is Build with m's source already open as src (nil: resolve
// m.Source): the file a bind clones (open_tree on the descriptor, so a
// path swapped since it was checked changes nothing), or the block device
// a filesystem is mounted from, which the new mount's device must then be
// (a device node swapped since is refused).
func BuildFrom(m plan.Mount, src *os.File) (*os.File, error) {
	o, err := parseOptions(m)
	if err != nil {
		return nil, err
	}
	if m.Type == plan.TypeBind {
		return buildBind(m, o, src)
	}
	f, err := buildFS(m, o, src)
	if err != nil || src == nil {
		return f, err
	}
	if err := sameDevice(f, src, m); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// sourceByFd are the filesystems whose mounts report an anonymous device
// rather than the block device they sit on: their source is handed to the
// kernel as the checked descriptor's magic link instead of its path.
var sourceByFd = map[string]bool{"btrfs": true}

// sameDevice checks that the mount built from m sits on src, the device
// that was checked.
func sameDevice(mnt, src *os.File, m plan.Mount) error {
	if sourceByFd[m.Type] {
		return nil
	}
	var dev unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &dev); err != nil {
		return &os.PathError{Op: "fstat", Path: m.Source, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(mnt.Fd()), &st); err != nil {
		return &os.PathError{Op: "fstat", Path: m.Source, Err: err}
	}
	if st.Dev != dev.Rdev {
		return fmt.Errorf("%s mount of %s sits on device %d, not on the %d that was checked (the node was replaced): %w",
			m.Type, m.Source, st.Dev, dev.Rdev, errdefs.ErrPermissionDenied)
	}
	return nil
}

func buildFS(m plan.Mount, o options, src *os.File) (*os.File, error) {
	fsfd, err := unix.Fsopen(m.Type, unix.FSOPEN_CLOEXEC)
	if errors.Is(err, unix.ENOSYS) {
		return nil, errNoNewAPI("fsopen")
	}
	if err != nil {
		return nil, &OpError{Op: "fsopen", FSType: m.Type, Path: m.Source, Err: err}
	}
	defer unix.Close(fsfd)

	fail := func(op, key string, err error) error {
		return &OpError{Op: op, FSType: m.Type, Path: m.Source, Key: key, Err: err, Kernel: kernelLog(fsfd, secretsOf(m))}
	}
	source := m.Source
	if src != nil && sourceByFd[m.Type] {
		source = fmt.Sprintf("/proc/self/fd/%d", src.Fd())
	}
	if source != "" {
		if err := unix.FsconfigSetString(fsfd, "source", source); err != nil {
			return nil, fail("fsconfig", "source", err)
		}
	}
	for _, f := range o.sbFlags {
		if err := unix.FsconfigSetFlag(fsfd, f); err != nil {
			return nil, fail("fsconfig", f, err)
		}
	}
	for _, d := range o.data {
		key, val, hasVal := strings.Cut(d, "=")
		if hasVal {
			err = unix.FsconfigSetString(fsfd, key, val)
		} else {
			err = unix.FsconfigSetFlag(fsfd, key)
		}
		if err != nil {
			return nil, fail("fsconfig", key, err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, fail("fsconfig", "create", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, int(o.attr))
	if err != nil {
		return nil, fail("fsmount", "", err)
	}
	return os.NewFile(uintptr(mfd), m.Type+":"+m.Source), nil
}

func buildBind(m plan.Mount, o options, src *os.File) (_ *os.File, err error) {
	// Never AT_RECURSIVE: the clone is the source's own mount alone, so a
	// mount someone put below the source (another volume's secrets, a host
	// directory) stays behind; parseOptions refuses "rec".
	flags := uint(unix.OPEN_TREE_CLONE | unix.OPEN_TREE_CLOEXEC)
	setFlags := uint(unix.AT_EMPTY_PATH)
	dirfd, name := unix.AT_FDCWD, m.Source
	if src != nil {
		dirfd, name = int(src.Fd()), ""
		flags |= unix.AT_EMPTY_PATH
	}
	fd, err := unix.OpenTree(dirfd, name, flags)
	runtime.KeepAlive(src)
	if errors.Is(err, unix.ENOSYS) {
		return nil, errNoNewAPI("open_tree")
	}
	if err != nil {
		return nil, &OpError{Op: "open_tree", Path: m.Source, Err: err}
	}
	f := os.NewFile(uintptr(fd), "bind:"+m.Source)
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	// A clone of a shared mount joins its peer group; a consumer's copy
	// must not propagate back into the host, so it is made private.
	attr := unix.MountAttr{Attr_set: o.attr, Propagation: unix.MS_PRIVATE}
	if o.atimeSet {
		attr.Attr_clr = unix.MOUNT_ATTR__ATIME
	}
	if err := unix.MountSetattr(int(f.Fd()), "", setFlags, &attr); err != nil {
		return nil, &OpError{Op: "mount_setattr", Path: m.Source, Err: err}
	}
	return f, nil
}

// kernelLog drains the messages the kernel logged on a filesystem context
// (read(2) on the fsopen fd), masking option values that could be secrets.
func kernelLog(fsfd int, secrets []string) []string {
	var msgs []string
	buf := make([]byte, 4096)
	for range 16 { // the kernel keeps at most 8 messages per context
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		msg := strings.TrimSpace(string(buf[:n]))
		for _, s := range secrets {
			msg = strings.ReplaceAll(msg, s, "***")
		}
		msgs = append(msgs, msg)
	}
	return msgs
}

// secretsOf lists the option values a kernel message must not repeat.
// Host paths (values starting with "/") are policy-checked and useful in an
// error; very short values are masked nowhere because they would garble the
// message and carry no secret.
func secretsOf(m plan.Mount) []string {
	var s []string
	for _, o := range m.Options {
		if _, v, ok := strings.Cut(o, "="); ok && len(v) >= 4 && !strings.HasPrefix(v, "/") {
			s = append(s, v)
		}
	}
	return s
}

// errOption reports an option that the mount type cannot take. Only the key
// is named: a value may be a secret.
func errOption(m plan.Mount, opt, why string) error {
	key, _, _ := strings.Cut(opt, "=")
	return fmt.Errorf("%s mount of %s: option %q %s: %w", m.Type, m.Source, key, why, errdefs.ErrInvalidArgument)
}
