//go:build linux

package peer_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/peer"
	"github.com/mountplan/mountplan/internal/unixrpc"
)

// listenEnv makes this test binary a stand-in plugin: it listens on the
// socket the variable names and waits to be killed.
const listenEnv = "MOUNTPLAN_PEER_TEST_LISTEN"

func TestMain(m *testing.M) {
	if path := os.Getenv(listenEnv); path != "" {
		l, err := net.Listen("unix", path)
		if err != nil {
			os.Exit(3)
		}
		defer l.Close()
		for {
			c, err := l.Accept()
			if err != nil {
				os.Exit(0)
			}
			c.Close()
		}
	}
	os.Exit(m.Run())
}

// plugin starts this binary as a plugin listening on a socket in dir, in a
// mount namespace of its own (unshare -m), and returns the socket and its
// PID once it listens.
func plugin(t *testing.T, dir string) (string, int) {
	t.Helper()
	sock := filepath.Join(dir, "csi.sock")
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", os.Args[0])
	cmd.Env = append(os.Environ(), listenEnv+"="+sock)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if pid, err := unixrpc.ListenerPID(sock); err == nil {
			return sock, pid
		}
	}
	t.Fatal("the stand-in plugin did not listen within 10s")
	return "", 0
}

// TestOnlyThePlugin (review of b705b24, F8): a caller of the mounter's
// socket of the right uid (root) but outside the plugin's mount namespace
// is refused; the plugin's own processes are served. At b705b24 every
// uid-0 process was served.
func TestOnlyThePlugin(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "unshare")
	dir := t.TempDir()
	sock, pluginPID := plugin(t, dir)
	p := peer.NewPlugin(sock)
	if err := p.Allow(pluginPID); err != nil {
		t.Errorf("the plugin's process: %v", err)
	}
	if err := p.Allow(os.Getpid()); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("a root process of another mount namespace = %v, want PermissionDenied", err)
	}
	if err := peer.NewPlugin(filepath.Join(dir, "none.sock")).Allow(os.Getpid()); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("with no plugin serving its socket = %v, want Unavailable", err)
	}

	// Through a server as the mounter runs it: this process (root, the
	// mounter's uid, not the plugin) calls and is dropped.
	srv := unixrpc.NewServer(klog.Background())
	unixrpc.Handle(srv, "Ping", func(context.Context, struct{}, []*os.File) (struct{}, error) { return struct{}{}, nil })
	srv.AllowPeer = p.Allow
	msock := filepath.Join(dir, "mounter.sock")
	l, err := net.Listen("unix", msock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	defer func() {
		cancel()
		<-done
	}()
	c := unixrpc.NewClient(msock)
	defer c.Close()
	callCtx, callCancel := context.WithTimeout(ctx, 5*time.Second)
	defer callCancel()
	if _, err := unixrpc.Call[struct{}, struct{}](callCtx, c, "Ping", struct{}{}); err == nil {
		t.Error("a caller outside the plugin's namespace was served")
	}
}

// TestOwnNamespace: with Own, a caller in the server's own mount namespace
// (kubelet's exec probe in the mounter's container) is admitted even when
// the plugin's socket does not answer; one in another namespace is not.
func TestOwnNamespace(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "unshare")
	dir := t.TempDir()
	_, other := plugin(t, dir)
	p := peer.NewPlugin(filepath.Join(dir, "none.sock"))
	p.Own = true
	if err := p.Allow(os.Getpid()); err != nil {
		t.Fatalf("a caller in the server's own mount namespace: %v", err)
	}
	if err := p.Allow(other); err == nil {
		t.Fatal("a caller in another mount namespace was admitted")
	}
}
