package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestCode(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want codes.Code
	}{
		{"nil", nil, codes.OK},
		{"wrapped invalid", fmt.Errorf("volume id %q: %w", "x", ErrInvalidArgument), codes.InvalidArgument},
		{"double wrapped not found", fmt.Errorf("a: %w", fmt.Errorf("b: %w", ErrNotFound)), codes.NotFound},
		{"aborted", ErrAborted, codes.Aborted},
		{"precondition", fmt.Errorf("staged: %w", ErrFailedPrecondition), codes.FailedPrecondition},
		{"permission denied", fmt.Errorf("login: %w", ErrPermissionDenied), codes.PermissionDenied},
		{"deadline", fmt.Errorf("wait: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{"plain error", errors.New("boom"), codes.Internal},
		{"status passes", status.Error(codes.Unavailable, "x"), codes.Unavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Code(tt.err); got != tt.want {
				t.Fatalf("Code(%v) = %v, want %v", tt.err, got, tt.want)
			}
			if tt.err == nil {
				return
			}
			if got := status.Code(ToGRPC(tt.err)); got != tt.want {
				t.Fatalf("status.Code(ToGRPC(%v)) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

func TestFromGRPCRoundTrip(t *testing.T) {
	orig := fmt.Errorf("volume v1 is staged: %w", ErrFailedPrecondition)
	back := FromGRPC(ToGRPC(orig))
	if !errors.Is(back, ErrFailedPrecondition) {
		t.Fatalf("FromGRPC lost the sentinel: %v", back)
	}
	if back.Error() != orig.Error() {
		t.Fatalf("message changed: %q != %q", back.Error(), orig.Error())
	}
}
