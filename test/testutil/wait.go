package testutil

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Poll calls cond every interval until it returns true or timeout passes,
// and reports whether cond returned true. cond is always called at least
// once, and once more at the deadline.
func Poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
}

// WantCode fails the test (without stopping it) unless err carries the
// gRPC code, and, when subs are given, unless its message mentions each.
func WantCode(t testing.TB, what string, err error, code codes.Code, subs ...string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Errorf("%s: got %v (%v), want %v", what, got, err, code)
		return
	}
	for _, s := range subs {
		if msg := status.Convert(err).Message(); !strings.Contains(msg, s) {
			t.Errorf("%s: message %q does not mention %q", what, msg, s)
		}
	}
}

// RetryAborted calls call again, as kubelet does, while it fails with
// Aborted (the volume is busy with another operation: the plugin's
// reconcile, a FUSE supervisor restarting its daemon), for up to 30
// seconds, and returns its last error.
func RetryAborted(call func() error) error {
	var err error
	Poll(30*time.Second, 50*time.Millisecond, func() bool {
		err = call()
		return status.Code(err) != codes.Aborted
	})
	return err
}
