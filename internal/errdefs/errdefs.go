// Package errdefs holds the sentinel errors every mountplan package wraps,
// and the one place where they become gRPC status codes.
//
// Packages below the gRPC layer never build a status themselves: they wrap
// one of these with %w and context ("attach /dev/loop3: %w"), and the service
// boundary calls ToGRPC once. An error that wraps none of them reaches the
// client as Internal, never as Unknown.
package errdefs

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrAborted            = errors.New("operation already in progress")
	ErrOutOfRange         = errors.New("out of range")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnimplemented      = errors.New("not implemented")
	ErrUnavailable        = errors.New("unavailable")
	ErrPermissionDenied   = errors.New("permission denied")
)

var table = []struct {
	err  error
	code codes.Code
}{
	{ErrInvalidArgument, codes.InvalidArgument},
	{ErrNotFound, codes.NotFound},
	{ErrAlreadyExists, codes.AlreadyExists},
	{ErrFailedPrecondition, codes.FailedPrecondition},
	{ErrAborted, codes.Aborted},
	{ErrOutOfRange, codes.OutOfRange},
	{ErrResourceExhausted, codes.ResourceExhausted},
	{ErrUnimplemented, codes.Unimplemented},
	{ErrUnavailable, codes.Unavailable},
	{ErrPermissionDenied, codes.PermissionDenied},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

// Code returns the gRPC code for err: the code of the first sentinel it
// wraps, the code of a status it already carries, or Internal.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	for _, e := range table {
		if errors.Is(err, e.err) {
			return e.code
		}
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return codes.Internal
}

// ToGRPC turns err into a status error with the code Code gives and err's
// message. A status error passes through unchanged.
func ToGRPC(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(Code(err), err.Error())
}

// FromGRPC turns a status error received from a peer back into an error
// that wraps the matching sentinel, so errors.Is works across the wire.
func FromGRPC(err error) error {
	s, ok := status.FromError(err)
	if !ok || err == nil {
		return err
	}
	for _, e := range table {
		if e.code == s.Code() {
			return &remoteError{msg: s.Message(), sentinel: e.err}
		}
	}
	return err
}

type remoteError struct {
	msg      string
	sentinel error
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.sentinel }
