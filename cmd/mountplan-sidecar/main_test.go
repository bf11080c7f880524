//go:build linux

package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// fakePlugin serves NodePrepare with a fixed plan.
type fakePlugin struct {
	api.UnimplementedNodePrepareServer
	mounts []plan.Mount

	mu         sync.Mutex
	unprepared []string
}

func (p *fakePlugin) NodePrepareVolume(_ context.Context, req *api.NodePrepareVolumeRequest) (*api.NodePrepareVolumeResponse, error) {
	return &api.NodePrepareVolumeResponse{Mounts: plan.ToProto(p.mounts), Consumer: req.GetConsumer()}, nil
}

func (p *fakePlugin) NodeUnprepareVolume(_ context.Context, req *api.NodeUnprepareVolumeRequest) (*api.NodeUnprepareVolumeResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.unprepared = append(p.unprepared, req.GetVolumeId())
	return &api.NodeUnprepareVolumeResponse{}, nil
}

func (p *fakePlugin) released() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string{}, p.unprepared...)
}

func startPlugin(t *testing.T, p *fakePlugin) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "plugin.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	api.RegisterNodePrepareServer(srv, p)
	go srv.Serve(l) //nolint:errcheck // ends with Stop
	t.Cleanup(srv.Stop)
	return "unix://" + sock
}

func TestMountAndUnmountCommands(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	p := &fakePlugin{mounts: []plan.Mount{{Type: "tmpfs", Source: "vol-1", Options: []string{"nosuid", "nodev"}},
		{Type: "tmpfs", Source: "vol-1-sub", Target: "sub", Options: []string{"nosuid", "nodev"}}}}
	endpoint := startPlugin(t, p)
	target := filepath.Join(dir, "mp")
	common := []string{"--plugin-endpoint", endpoint, "--volume-id", "vol-1", "--pid", strconv.Itoa(pid), "--target", target}

	if err := run(context.Background(), "mount", append(common, "--staging-path", "/staging", "--state-dir", dir, "--records-dir", t.TempDir())); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 2 {
		t.Fatalf("%d mounts in the namespace, want 2", n)
	}
	if err := run(context.Background(), "unmount", append(common, "--remove-target")); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 0 {
		t.Fatalf("%d mounts left in the namespace", n)
	}
	if _, err := os.Lstat(filepath.Join("/proc", strconv.Itoa(pid), "root", target)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("target not removed: %v", err)
	}
	if got := p.released(); len(got) != 1 || got[0] != "vol-1" {
		t.Fatalf("released %v, want [vol-1]", got)
	}
}

// TestMountCommandReleasesOnFailure: a plan binding what lies outside the
// state dir (the host's /etc) is refused, and the claim released.
func TestMountCommandReleasesOnFailure(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	p := &fakePlugin{mounts: []plan.Mount{{Type: "bind", Source: "/etc", Options: []string{"nosuid", "nodev"}}}}
	endpoint := startPlugin(t, p)
	err := run(context.Background(), "mount", []string{"--plugin-endpoint", endpoint, "--volume-id", "vol-2",
		"--staging-path", "/staging", "--pid", strconv.Itoa(os.Getpid()), "--target", filepath.Join(dir, "mp"),
		"--state-dir", dir, "--records-dir", t.TempDir()})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("mount = %v, want InvalidArgument (a bind from outside the state dir)", err)
	}
	if got := p.released(); len(got) != 1 || got[0] != "vol-2" {
		t.Fatalf("released %v, want [vol-2]", got)
	}
}

func TestServeCommand(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	pid := mountnstest.Namespace(t, "private")
	sock := filepath.Join(dir, "mounter.sock")
	records := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, "serve", []string{"--endpoint", "unix://" + sock, "--state-dir", dir, "--records-dir", records})
	}()
	// Serving starts asynchronously: wait until the socket accepts (the
	// file exists from bind(2) on, before listen(2): a connection in
	// between is refused).
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if conn, err := net.Dial("unix", sock); err == nil {
			conn.Close()
			break
		}
	}
	m := service.NewClient(sock)
	defer m.Close()
	c := plan.Consumer{PID: pid, MountPoint: filepath.Join(dir, "mp")}
	mounts := []plan.Mount{{Type: "tmpfs", Source: "served", Options: []string{"nosuid", "nodev"}}}
	callCtx, callCancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer callCancel()
	// serve acts only on what it can attribute: a namespace nobody named
	// is refused, one an admin's mount command named is served.
	if err := m.Mount(callCtx, mounts, c); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("Mount into a namespace nobody named = %v, want PermissionDenied", err)
	}
	admin, err := mounter.NewNode(callCtx, mounter.Options{StateDir: dir, RecordsDir: records, Observe: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Attribute(callCtx, pid, mounter.ByAdmin, ""); err != nil {
		t.Fatal(err)
	}
	admin.Close()
	if err := m.Mount(callCtx, mounts, c); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount(callCtx, mounts, c); err != nil {
		t.Fatal(err)
	}
	if n := len(mountnstest.MountsUnder(t, pid, dir)); n != 0 {
		t.Fatalf("%d mounts left", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind: %v", err)
	}
}

// TestServeConfig: a bad config stops serve at once.
func TestServeConfig(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("fuseProfiles: [{name: x}]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := run(context.Background(), "serve", []string{"--endpoint", "unix://" + filepath.Join(dir, "bad.sock"), "--config", bad,
		"--state-dir", dir, "--records-dir", t.TempDir()})
	if err == nil {
		t.Error("serve accepted an invalid config")
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"nosuch"},
		{"mount", "--volume-id", "v"},
		{"serve"},
		{"unmount", "--plugin-endpoint", "unix:///x", "--volume-id", "v", "--pid", "1", "--target", "/x", "extra"},
		// The plugin owns the state dir: the mounter's records stay out of it.
		{"serve", "--endpoint", "unix:///x", "--state-dir", "/var/lib/mp", "--records-dir", "/var/lib/mp/mounter"},
		{"serve", "--endpoint", "unix:///x", "--state-dir", "/var/lib/mp", "--records-dir", "/var/lib/mp"},
		{"serve", "--endpoint", "unix:///x", "--state-dir", "/var/lib/mp", "--records-dir", "/var"},
		{"serve", "--endpoint", "unix:///x", "--state-dir", "/var/lib/mp", "--records-dir", "records"},
		{"mount", "--plugin-endpoint", "unix:///x", "--volume-id", "v", "--staging-path", "/s", "--pid", "1", "--target", "/x",
			"--state-dir", "/var/lib/mp", "--records-dir", "/var/lib/mp/mounter"},
	} {
		if err := run(context.Background(), args[0], args[1:]); !errors.Is(err, errUsage) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// TestPrivateSocketDir: the socket's own directory becomes 0700; one
// shared with other files (a /run given by hand) keeps its mode.
func TestPrivateSocketDir(t *testing.T) {
	own, shared := filepath.Join(t.TempDir(), "own"), t.TempDir()
	if err := os.Mkdir(own, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(shared, "other.pid"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for dir, want := range map[string]os.FileMode{own: 0o700, shared: 0o755} {
		if err := privateSocketDir(klog.Background(), filepath.Join(dir, "mounter.sock")); err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v (%v), want %v", dir, fi.Mode().Perm(), err, want)
		}
	}
}
