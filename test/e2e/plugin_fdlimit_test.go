package e2e

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestPluginStagesBeyondFileLimit: the plugin holds one open file per
// staged loop volume, so it raises its own RLIMIT_NOFILE at start
// (internal/fdlimit). Started with a soft limit of 64 open files (as a container
// runtime sets 1,024), it stages more loop volumes than that limit would
// allow, and its limit shows the raise. The hard limit stays as it is: this
// machine's root has no CAP_SYS_RESOURCE, without which neither the plugin
// could raise it nor the test restore its own.
func TestPluginStagesBeyondFileLimit(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	const limit, volumes = 64, 80

	// The plugin inherits the limit in force when it starts: lower this
	// process's soft limit for that moment (syscall.Setrlimit also stops
	// Go from giving children the limit this process started with).
	testutil.BuildBinaries(t) // before: go build needs more than 64 files
	var saved syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &saved); err != nil {
		t.Fatal(err)
	}
	if saved.Max <= volumes+64 {
		t.Fatalf("hard open file limit %d leaves no room to show a raise", saved.Max)
	}
	restore := func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &saved); err != nil {
			t.Fatalf("restoring RLIMIT_NOFILE: %v", err)
		}
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: limit, Max: saved.Max}); err != nil {
		t.Fatal(err)
	}
	e := func() *env { defer restore(); return startEnv(t, envOptions{}) }()

	if soft := openFileLimit(t, e.plugin.PID()); soft <= volumes {
		t.Fatalf("the plugin's open file limit is %d: not raised above %d", soft, volumes)
	}
	ids := make([]string, 0, volumes)
	for i := range volumes {
		id := fmt.Sprintf("fdlimit-%03d", i)
		e.createFor(id, 16<<20, blockCap(rwo))
		e.stage(id, blockCap(rwo), nil)
		ids = append(ids, id)
	}
	for _, id := range ids {
		e.unstage(id)
		e.delete(id)
	}
}

// openFileLimit reads the soft "Max open files" of pid.
func openFileLimit(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Max open files"); ok {
			var soft int
			if _, err := fmt.Sscan(strings.TrimSpace(rest), &soft); err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			return soft
		}
	}
	t.Fatalf("no Max open files in /proc/%d/limits", pid)
	return 0
}
