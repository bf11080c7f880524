package loopdev

import (
	"errors"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// opError says which call failed on which path. It unwraps to both the
// errno (so callers can test unix.EBUSY) and the errdefs sentinel the errno
// maps to (so the service boundary picks the right gRPC code).
type opError struct {
	op       string // "LOOP_CONFIGURE", "open", ...
	path     string
	sentinel error
	err      error
}

func (e *opError) Error() string {
	return "loopdev: " + e.op + " " + e.path + ": " + e.err.Error()
}

func (e *opError) Unwrap() []error {
	if e.sentinel == nil {
		return []error{e.err}
	}
	return []error{e.sentinel, e.err}
}

func sysErr(op, path string, err error) error {
	return &opError{op: op, path: path, sentinel: sentinelFor(err), err: err}
}

// sentinelFor maps the errnos the loop driver returns to errdefs sentinels.
func sentinelFor(err error) error {
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENXIO), errors.Is(err, unix.ENODEV):
		return errdefs.ErrNotFound
	case errors.Is(err, unix.EBUSY), errors.Is(err, unix.EAGAIN):
		return errdefs.ErrUnavailable
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EMFILE), errors.Is(err, unix.ENFILE):
		return errdefs.ErrResourceExhausted
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.EISDIR):
		return errdefs.ErrInvalidArgument
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES), errors.Is(err, unix.EROFS):
		return errdefs.ErrFailedPrecondition
	case errors.Is(err, unix.ENOTTY):
		return errdefs.ErrUnimplemented
	}
	return nil
}
