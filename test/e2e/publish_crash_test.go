package e2e

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestPublishSurvivesPluginCrashDuringMount is issue 11's item 5: the
// plugin records a publish, asks its mounter, and is killed with SIGKILL
// before the answer; the mounter, stopped meanwhile (SIGSTOP: the request
// waits in its socket), goes on once the plugin is dead and restarted.
// Whether it then completes the mount behind the new plugin's back or
// drops the request of a caller that is gone (internal/unixrpc cancels it),
// the unpublish kubelet sends next must leave no mount and no target and
// answer OK, not NotFound for ever. (The mounter no longer blocks on a
// FUSE source inside Mount: it stats nothing through the daemon.)
func TestPublishSurvivesPluginCrashDuringMount(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "rclone")
	testutil.NoLeaks(t)
	e := newFuseEnv(t, "")
	e.startMounter("")
	// No probes or periodic reconcile while the mounter is stopped: only
	// the startup reconcile of the restarted plugin runs.
	e.startPlugin("", "--v=5", "--fuse-probe-interval", "1h", "--fuse-probe-timeout", "1h", "--reconcile-interval", "1h")

	const id = "crash-publish"
	src := filepath.Join(e.rcloneRoot, "data")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "hello"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := e.tryStage(id, mountCap("", rwo), map[string]string{"type": "fuse", "profile": "rclone", "source": src}, nil); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e.dir, "pods", "p1", "volumes", id, "mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		t.Fatal(err)
	}

	// Stop the mounter, then publish: the plugin records the publish and
	// its request waits.
	mounter := e.mounter.pid()
	if err := syscall.Kill(mounter, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := true
	defer func() {
		if stopped {
			_ = syscall.Kill(mounter, syscall.SIGCONT)
		}
	}()
	published := make(chan error, 1)
	go func() {
		_, err := e.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: id,
			StagingTargetPath: e.staging(id), TargetPath: target, VolumeCapability: mountCap("", rwo)})
		published <- err
	}()
	if !testutil.Poll(20*time.Second, 10*time.Millisecond, func() bool { v, err := e.record(id); return err == nil && len(v.Publishes) == 1 }) {
		t.Fatal("the publish is never recorded before the mounter answers")
	}

	// The plugin dies while its request waits, and comes back once the
	// mounter runs again.
	e.plugin.Kill9()
	if err := <-published; err == nil {
		t.Fatal("the publish answered OK though its plugin was killed")
	}
	if err := syscall.Kill(mounter, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	stopped = false
	e.plugin.Restart()
	e.waitReady()
	if m, _ := mountinfo.Mounted(target); m {
		t.Log("the mounter completed the dead plugin's mount")
	} else {
		t.Log("the mounter dropped the dead plugin's request")
	}

	// kubelet's unpublish removes it.
	unpublish := func() error {
		_, err := e.node.NodeUnpublishVolume(e.ctx(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		return err
	}
	if err := unpublish(); err != nil {
		t.Fatalf("NodeUnpublishVolume after the crash: %v", err)
	}
	if m, _ := mountinfo.Mounted(target); m {
		t.Errorf("%s is still mounted after the unpublish", target)
	}
	if _, err := os.Lstat(target); !os.IsNotExist(err) {
		t.Errorf("the target the plugin made is still there: %v", err)
	}
	if err := unpublish(); err != nil {
		t.Errorf("repeated NodeUnpublishVolume: %v", err)
	}
	e.unstage(id)
	e.checkClean(id)
}
