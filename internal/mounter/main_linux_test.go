//go:build linux

package mounter_test

import (
	"os"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
)

// TestMain lets this test binary be the sandbox of a daemon in fd mode:
// the mounter (this process in the tests) re-executes /proc/self/exe for
// it, as mountplan-sidecar re-executes itself.
func TestMain(m *testing.M) {
	daemon.ServeSandboxIfAsked()
	os.Exit(m.Run())
}
