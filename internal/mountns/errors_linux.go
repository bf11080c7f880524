package mountns

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// OpError says which mount syscall failed on which path. It never holds
// option values, only keys, because a value may be a secret; kernel messages
// are kept with option values masked out.
type OpError struct {
	Op     string   // syscall: "fsopen", "fsconfig", "fsmount", "open_tree", "mount_setattr", "move_mount", "umount2"
	FSType string   // filesystem type, if any
	Path   string   // the mount's source, or the target for move_mount and umount2
	Key    string   // fsconfig key, if any
	Kernel []string // what the kernel logged on the filesystem context
	Err    error    // the errno
}

func (e *OpError) Error() string {
	var b strings.Builder
	b.WriteString(e.Op)
	if e.FSType != "" {
		b.WriteString(" " + e.FSType)
	}
	if e.Path != "" {
		fmt.Fprintf(&b, " %s", e.Path)
	}
	if e.Key != "" {
		fmt.Fprintf(&b, " (key %q)", e.Key)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	if len(e.Kernel) > 0 {
		b.WriteString(" (kernel: " + strings.Join(e.Kernel, "; ") + ")")
	}
	return b.String()
}

// Unwrap gives both the errno and the errdefs sentinel it maps to, so callers
// can test either with errors.Is.
func (e *OpError) Unwrap() []error {
	if s := sentinel(e.Err); s != nil {
		return []error{e.Err, s}
	}
	return []error{e.Err}
}

// Classify returns err so that errors.Is also finds the errdefs sentinel its
// errno maps to (ENOENT: NotFound, EINVAL: InvalidArgument, EBUSY, EPERM,
// EROFS: FailedPrecondition, ENOSPC: ResourceExhausted). The message stays.
func Classify(err error) error {
	s := sentinel(err)
	if s == nil || errors.Is(err, s) {
		return err
	}
	return &classified{err: err, sentinel: s}
}

type classified struct{ err, sentinel error }

func (e *classified) Error() string   { return e.err.Error() }
func (e *classified) Unwrap() []error { return []error{e.err, e.sentinel} }

// sentinel maps an errno from a mount syscall to the errdefs sentinel that
// describes it to a CSI caller, or nil when none fits (Internal).
func sentinel(err error) error {
	var errno unix.Errno
	if !errors.As(err, &errno) {
		return nil
	}
	switch errno {
	case unix.ENOENT, unix.ENOTDIR, unix.ENXIO, unix.ESRCH:
		return errdefs.ErrNotFound
	case unix.EINVAL, unix.ENODEV, unix.ENOTBLK, unix.E2BIG:
		return errdefs.ErrInvalidArgument
	case unix.EBUSY, unix.EPERM, unix.EACCES, unix.EROFS, unix.ENOSYS, unix.ELOOP:
		return errdefs.ErrFailedPrecondition
	case unix.ENOMEM, unix.ENOSPC, unix.EMFILE, unix.ENFILE:
		return errdefs.ErrResourceExhausted
	}
	return nil
}

// errNoNewAPI explains ENOSYS from the new mount API.
func errNoNewAPI(op string) error {
	return fmt.Errorf("%s: kernel lacks the new mount API (fsopen/move_mount, Linux 5.2+): %w", op, errdefs.ErrFailedPrecondition)
}
