package e2e

// A consumer whose target lies on a mount that shares mount events with the
// host: a mount made there would propagate into the host's namespace and
// outlive the consumer. The sidecar refuses it and releases the claim; a
// slave mount (events flow from the host only) is fine.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// prepStartUnshare starts `unshare --mount --propagation PROP sleep
// infinity` and returns its PID once it is in its own mount namespace. A
// cleanup kills it.
func prepStartUnshare(t *testing.T, propagation string) int {
	t.Helper()
	cmd := exec.Command("unshare", "--mount", "--propagation", propagation, "sleep", "infinity")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	self, err := testutil.MountNamespaceOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if !testutil.Poll(5*time.Second, 5*time.Millisecond, func() bool {
		ns, _ := testutil.MountNamespaceOf(pid)
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		return ns != "" && ns != self && strings.TrimSpace(string(comm)) == "sleep"
	}) {
		t.Fatalf("unshare --propagation %s did not enter a new namespace: %s", propagation, stderr.String())
	}
	return pid
}

func TestPrepareRefusesSharedTarget(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	id := e.create("prep-shared", "", 16*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)
	watch := prepDevWatch(t, dev)

	// A shared mount in the host namespace; namespaces copied with
	// propagation unchanged get a peer of it, slave ones a slave.
	shared := filepath.Join(e.dir, "shared")
	if err := os.Mkdir(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("mptest-shared", shared, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(shared, unix.MNT_DETACH) })
	if err := unix.Mount("", shared, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(shared, "vol")

	peer := prepStartUnshare(t, "unchanged")
	out, code := e.sidecarMount(id, peer, target)
	if code != 1 || !strings.Contains(out, "shares mount events") {
		t.Errorf("mount under a mount shared with the host: exit %d, want 1 and the reason:\n%s", code, out)
	}
	e.wantNoConsumer(id)
	if mi := prepHostMountAt(t, target); mi != nil {
		t.Errorf("the volume propagated to the host at %s: %s %s", target, mi.FSType, mi.Source)
	}
	if hasMount(t, peer, target) {
		t.Errorf("the refused mount is left in the consumer's namespace at %s", target)
	}
	if ents, err := os.ReadDir(shared); err != nil || len(ents) != 0 {
		t.Errorf("the refused mount left %v in %s (%v)", ents, shared, err)
	}

	slave := prepStartUnshare(t, "slave")
	e.mustSidecarMount(id, slave, target)
	e.wantConsumer(id, slave, target)
	if !hasMount(t, slave, target) {
		t.Errorf("no mount at %s in the slave namespace", target)
	}
	if mi := prepHostMountAt(t, target); mi != nil {
		t.Errorf("the volume mounted in a slave namespace propagated to the host: %s %s", mi.FSType, mi.Source)
	}
	if hasMount(t, peer, target) {
		t.Errorf("the volume mounted in a slave namespace propagated to another namespace")
	}
	e.mustSidecarUnmount(id, slave, target)
	e.wantNoConsumer(id)
	e.unstage(id)
	waitNoLoop(t, image)
	e.delete(id)
	watch.check(t, dev.String()+" mounted")
}
