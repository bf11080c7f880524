//go:build linux

package service_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestDaemonsThroughTheSocket: the plugin's side of a FUSE daemon's life
// crosses the socket (start, status, a wait its context ends, a wait the
// daemon's death ends, stop), and the refusals of hostile starts arrive
// with their sentinels (review finding 5a, ported from
// TestHostileOld_5a_SecretsDirSymlink: a secrets dir that is a symlink out
// of the state dir, to a directory holding a file of the secret's name,
// starts nothing).
func TestDaemonsThroughTheSocket(t *testing.T) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	testutil.NoLeaks(t)
	dir := mountnstest.Scratch(t)
	state, images, outside := filepath.Join(dir, "state"), filepath.Join(dir, "images"), filepath.Join(dir, "outside")
	content := filepath.Join(dir, "content")
	for _, d := range []string{state, images, outside, content} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("hi\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(images, "img.sqfs")
	mountnstest.Squashfs(t, content, img)
	hostKeys := filepath.Join(outside, "ssh")
	if err := os.Mkdir(hostKeys, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostKeys, "key"), []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/", filepath.Join(state, "escape")); err != nil {
		t.Fatal(err)
	}
	cfg := &config.Config{FuseProfiles: []fuseprofile.Profile{{Name: "squash", Binary: "/usr/bin/squashfuse",
		Args: []string{"-f", "{source}", "{mountpoint}", "-o", "fsname={secret:key}"}, Source: fuseprofile.SourceRule{Roots: []string{images}},
		Secrets: []fuseprofile.Secret{{Name: "key"}}}}}
	c := serveWith(t, mounter.Options{StateDir: state, KubeletDir: state, RecordsDir: filepath.Join(dir, "records"), Config: cfg})
	ctx := context.Background()
	req := func(id string) mounter.DaemonRequest {
		return mounter.DaemonRequest{VolumeID: id, Profile: "squash", Params: map[string]string{"profile": "squash", "source": img},
			Secrets: map[string]string{"key": "the volume's key"}, Generation: 1, ReadyTimeout: 10 * time.Second}
	}

	for i, to := range []string{hostKeys, filepath.Join(state, "escape", hostKeys[1:])} {
		id := []string{"linked", "escaped"}[i]
		if err := os.MkdirAll(filepath.Join(state, "fuse", id), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(to, filepath.Join(state, "fuse", id, "secrets")); err != nil {
			t.Fatal(err)
		}
		_, err := c.StartDaemon(ctx, req(id))
		if !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Errorf("StartDaemon with secrets dir -> %s = %v, want PermissionDenied", to, err)
		}
		if ms := mountnstest.MountsUnder(t, 0, dir); len(ms) > 0 {
			t.Errorf("the refused start mounted %s", ms[0].Mountpoint)
		}
	}
	if b, err := os.ReadFile(filepath.Join(hostKeys, "key")); err != nil || string(b) != "-----BEGIN OPENSSH PRIVATE KEY-----\n" {
		t.Errorf("the host's key: %q, %v", b, err)
	}
	if _, err := c.StartDaemon(ctx, mounter.DaemonRequest{VolumeID: "x", Profile: "nfs", Generation: 1}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("StartDaemon of an unknown profile = %v, want InvalidArgument", err)
	}

	info, err := c.StartDaemon(ctx, req("vol"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.StopDaemons(ctx, "vol", nil, true) //nolint:errcheck // best effort
	if b, err := os.ReadFile(filepath.Join(info.MountPoint, "hello.txt")); err != nil || string(b) != "hi\n" {
		t.Errorf("reading through the mount: %q, %v", b, err)
	}
	if st, err := c.DaemonStatus(ctx, info.Proc, info.Conn); err != nil || !st.Alive {
		t.Errorf("DaemonStatus = %+v, %v", st, err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err = c.WaitDaemon(short, info.Proc)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitDaemon ended by its context = %v", err)
	}
	waited := make(chan error, 1)
	go func() { waited <- c.WaitDaemon(ctx, info.Proc) }()
	time.Sleep(100 * time.Millisecond)
	if err := syscall.Kill(info.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("WaitDaemon of a killed daemon = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WaitDaemon did not return within 5s of the kill")
	}
	for _, id := range []string{"vol", "linked", "escaped"} {
		if err := c.StopDaemons(ctx, id, nil, true); err != nil {
			t.Errorf("StopDaemons %s: %v", id, err)
		}
		if _, err := os.Lstat(filepath.Join(state, "fuse", id)); err == nil {
			t.Errorf("%s is left after the teardown", id)
		}
	}
}

// serveWith runs a node of o on a socket until the test ends and returns
// the plugin's client of it.
func serveWith(t *testing.T, o mounter.Options) *service.Client {
	t.Helper()
	n, err := mounter.NewNode(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "mounter.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- service.Serve(klog.NewContext(ctx, klog.Background()), l, n) }()
	c := service.NewClient(sock)
	t.Cleanup(func() {
		c.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		n.Close()
	})
	return c
}
