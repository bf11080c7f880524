//go:build linux

package fuse

import (
	"os"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
)

// TestMain lets this test binary be the sandbox of a daemon in fd mode
// (TestSupervisorWithTheMounter/fd-mode): the mounter, in this process,
// re-executes /proc/self/exe for it, as mountplan-sidecar re-executes
// itself.
func TestMain(m *testing.M) {
	daemon.ServeSandboxIfAsked()
	os.Exit(m.Run())
}
