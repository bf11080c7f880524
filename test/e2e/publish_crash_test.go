package e2e

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
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
// The plugin asks the mounter about the target before it records the
// publish (it does not see kubelet's directory, issue 33 F4), so the
// mounter is stopped when the Mount itself is on its way: a proxy between
// the two holds that request until then (holdMount).
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
	proxy := filepath.Join(e.short, "proxy.sock")
	held, release := holdMount(t, proxy, e.mounter.socket)
	// No probes or periodic reconcile while the mounter is stopped: only
	// the startup reconcile of the restarted plugin runs.
	e.startPlugin("", "--v=5", "--fuse-probe-interval", "1h", "--fuse-probe-timeout", "1h", "--reconcile-interval", "1h",
		"--mounter-endpoint", "unix://"+proxy)

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

	// Publish; once its Mount is on the way, stop the mounter and let the
	// request into its socket: the plugin has recorded the publish and
	// its request waits.
	published := make(chan error, 1)
	go func() {
		_, err := e.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: id,
			StagingTargetPath: e.staging(id), TargetPath: target, VolumeCapability: mountCap("", rwo)})
		published <- err
	}()
	select {
	case <-held:
	case err := <-published:
		t.Fatalf("the publish answered (%v) before its Mount reached the mounter", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the publish never asks the mounter to mount")
	}
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
	release()
	if v, err := e.record(id); err != nil || len(v.Publishes) != 1 {
		t.Fatalf("the publish is not recorded before the mounter answers: %+v, %v", v, err)
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

// holdMount serves a proxy of the mounter's socket at proxy: it passes
// every call through, unchanged, but the first Mount request, which it
// holds until the test calls release (held says it is there), then
// passes on and returns. Descriptors (SCM_RIGHTS) do not pass: the FUSE
// volume of this test sends none.
func holdMount(t *testing.T, proxy, mounter string) (held <-chan struct{}, release func()) {
	t.Helper()
	l, err := net.Listen("unix", proxy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	heldc, releasec, forwarded := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			m, err := net.Dial("unix", mounter)
			if err != nil {
				c.Close()
				continue
			}
			go func() { _, _ = io.Copy(c, m); c.Close() }()
			go func() {
				defer m.Close()
				for {
					var hdr [4]byte
					if _, err := io.ReadFull(c, hdr[:]); err != nil {
						return
					}
					body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
					if _, err := io.ReadFull(c, body); err != nil {
						return
					}
					var req struct {
						Method string `json:"m"`
					}
					first := false
					if json.Unmarshal(body, &req) == nil && req.Method == "Mount" {
						once.Do(func() { first = true; close(heldc); <-releasec })
					}
					if _, err := m.Write(append(hdr[:], body...)); err != nil {
						return
					}
					if first {
						close(forwarded)
					}
				}
			}()
		}
	}()
	return heldc, func() {
		close(releasec)
		select {
		case <-forwarded:
		case <-time.After(10 * time.Second):
			t.Fatal("the held Mount request was never passed on")
		}
	}
}
