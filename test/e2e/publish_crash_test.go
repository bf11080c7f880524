package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestPublishSurvivesPluginCrashDuringMount is issue 11's item 5, made
// deterministic: the sidecar is caught inside a publish's Mount (its
// FUSE source stopped answering: the mounter waits on it in the kernel),
// the plugin is killed with SIGKILL and restarted, then the mounter goes
// on and completes the mount behind the new plugin's back. The unpublish
// kubelet sends next must remove that mount and answer OK, not NotFound
// for ever.
func TestPublishSurvivesPluginCrashDuringMount(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "rclone")
	testutil.NoLeaks(t)
	e := newFuseEnv(t, "")
	// An rclone profile without attribute caching: every stat of its
	// mount reaches the daemon, so a stopped daemon stops whoever looks.
	profile := fmt.Sprintf(`
- name: rclone-nocache
  binary: /usr/bin/rclone
  args: [mount, "{source}", "{mountpoint}", --config, /dev/null, --cache-dir, "{workdir}", --allow-other, --attr-timeout, "0s", "{options}"]
  source: {roots: [%s]}
  readyTimeout: 20s
`, e.rcloneRoot)
	appendFile(t, e.config, profile)
	e.startMounter("")
	// No probes or periodic reconcile while the daemon is stopped: only
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
	if err := e.tryStage(id, mountCap("", rwo), map[string]string{"type": "fuse", "profile": "rclone-nocache", "source": src}, nil); err != nil {
		t.Fatal(err)
	}
	daemon := e.state(id).Daemon
	target := filepath.Join(e.dir, "pods", "p1", "volumes", id, "mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		t.Fatal(err)
	}

	// Stop the daemon, then publish: the mounter blocks on the stopped
	// daemon inside its Mount, before it attaches anything.
	if err := syscall.Kill(daemon.PID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := true
	defer func() {
		if stopped {
			_ = syscall.Kill(daemon.PID, syscall.SIGCONT)
		}
	}()
	published := make(chan error, 1)
	go func() {
		_, err := e.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: id,
			StagingTargetPath: e.staging(id), TargetPath: target, VolumeCapability: mountCap("", rwo)})
		published <- err
	}()
	if !testutil.Poll(20*time.Second, 10*time.Millisecond, func() bool { return waitsOnFuse(e.mounter.pid()) }) {
		t.Fatalf("the mounter (pid %d) never blocked on the stopped FUSE daemon", e.mounter.pid())
	}
	if v, err := e.record(id); err != nil || len(v.Publishes) != 1 {
		t.Fatalf("the publish is not recorded before the mounter is asked: %+v %v", v, err)
	}

	// The plugin dies while the mounter is at work, and comes back.
	e.plugin.Kill9()
	if err := <-published; err == nil {
		t.Fatal("the publish answered OK though its plugin was killed")
	}
	e.plugin.Restart()
	e.waitReady()

	// The mounter goes on and completes the mount.
	if err := syscall.Kill(daemon.PID, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	stopped = false
	if !testutil.Poll(20*time.Second, 20*time.Millisecond, func() bool { m, _ := mountinfo.Mounted(target); return m }) {
		t.Fatal("the mounter never completed the mount after SIGCONT")
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

// waitsOnFuse reports whether a thread of pid sleeps on a FUSE request.
func waitsOnFuse(pid int) bool {
	tasks, _ := filepath.Glob(filepath.Join("/proc", strconv.Itoa(pid), "task", "*", "wchan"))
	for _, w := range tasks {
		b, _ := os.ReadFile(w)
		if s := string(b); strings.Contains(s, "fuse") || strings.Contains(s, "request_wait_answer") {
			return true
		}
	}
	return false
}

func appendFile(t *testing.T, path, text string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(text); err != nil {
		t.Fatal(err)
	}
}
