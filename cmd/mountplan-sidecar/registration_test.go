//go:build linux

package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

const (
	testDriver      = "mountplan.csi.io"
	testCSIEndpoint = "/var/lib/kubelet/plugins/mountplan.csi.io/csi.sock"
)

// registrationArgs are serve's registration flags for a socket in dir,
// waiting for the plugin's socket pluginSock.
func registrationArgs(dir, pluginSock string) []string {
	return []string{"--registration-socket", filepath.Join(dir, testDriver+"-reg.sock"),
		"--kubelet-registration-path", testCSIEndpoint, "--driver-name", testDriver, "--plugin-endpoint", "unix://" + pluginSock}
}

// getInfo plays kubelet's plugin watcher: GetInfo on the registration socket.
func getInfo(t *testing.T, sock string) (*registerapi.PluginInfo, error) {
	t.Helper()
	conn, err := endpoint.Dial("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
}

// wantInfo checks GetInfo's answer: the flags' driver name and CSI socket,
// whatever the plugin is.
func wantInfo(t *testing.T, sock string) {
	t.Helper()
	info, err := getInfo(t, sock)
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != testDriver || info.Endpoint != testCSIEndpoint {
		t.Fatalf("GetInfo = %+v, want a CSI plugin %s at %s", info, testDriver, testCSIEndpoint)
	}
}

func socketExists(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.Mode().Type() == os.ModeSocket
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// listenPlugin stands for the plugin's CSI socket: it only has to accept
// connections (the kernel does, from its backlog).
func listenPlugin(t *testing.T, sock string) {
	t.Helper()
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// TestRegistrationFollowsThePlugin: no registration socket before the
// plugin's socket accepts a connection (kubelet would dial it and, refused,
// retry only on its backoff); then one that answers with the flags' name
// and CSI socket; made again when removed; removed at the end.
func TestRegistrationFollowsThePlugin(t *testing.T) {
	defer func(c, p time.Duration) { registrationCheckInterval, pluginPollInterval = c, p }(registrationCheckInterval, pluginPollInterval)
	registrationCheckInterval, pluginPollInterval = 20*time.Millisecond, 10*time.Millisecond
	dir := t.TempDir()
	pluginSock, regSock := filepath.Join(dir, "csi.sock"), filepath.Join(dir, testDriver+"-reg.sock")
	fs := newFlagSet("serve")
	rf := addRegistrationFlags(fs)
	args := registrationArgs(dir, pluginSock)
	if err := fs.Parse(args[:len(args)-2]); err != nil {
		t.Fatal(err)
	}
	stop, err := rf.start(context.Background(), "unix://"+pluginSock)
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()

	time.Sleep(20 * pluginPollInterval)
	if socketExists(regSock) {
		t.Fatal("registration socket made before the plugin's socket accepted a connection")
	}
	listenPlugin(t, pluginSock)
	eventually(t, "the registration socket", func() bool { return socketExists(regSock) })
	wantInfo(t, regSock)

	// Removed (kubelet then forgets the plugin): made again, and served.
	// (Not told apart by inode: tmpfs gives the new socket the old one's.)
	if err := os.Remove(regSock); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a new registration socket", func() bool { return socketExists(regSock) })
	wantInfo(t, regSock)

	stop()
	stopped = true
	if _, err := os.Lstat(regSock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("registration socket after stop: %v", err)
	}
}

// TestRegistrationFlags: the registration flags go together, with the
// plugin's endpoint to wait for, and are checked before serve starts.
func TestRegistrationFlags(t *testing.T) {
	dir := t.TempDir()
	full := registrationArgs(dir, filepath.Join(dir, "csi.sock"))
	base := []string{"--endpoint", "unix://" + filepath.Join(dir, "mounter.sock"), "--state-dir", dir, "--records-dir", t.TempDir()}
	for name, args := range map[string][]string{
		"no driver name":       {full[0], full[1], full[2], full[3], full[6], full[7]},
		"no registration path": {full[0], full[1], full[4], full[5], full[6], full[7]},
		"no socket":            {full[2], full[3], full[4], full[5], full[6], full[7]},
		"no plugin endpoint":   full[:6],
		"relative socket":      append([]string{"--registration-socket", "reg.sock"}, full[2:]...),
		"relative path":        append(append(full[:2:2], "--kubelet-registration-path", "csi.sock"), full[4:]...),
		"bad plugin endpoint":  append(full[:6:6], "--plugin-endpoint", "/csi.sock"),
	} {
		t.Run(name, func(t *testing.T) {
			if err := run(context.Background(), "serve", append(base[:len(base):len(base)], args...)); !errors.Is(err, errUsage) {
				t.Fatalf("serve %q = %v, want a usage error", args, err)
			}
		})
	}
	if _, err := os.Lstat(filepath.Join(dir, testDriver+"-reg.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused command line made the registration socket: %v", err)
	}
}

// TestServeRegisters: serve started with the registration flags registers
// the plugin with kubelet: the socket answers GetInfo with the flags' name
// and CSI socket, and is gone when serve stops.
func TestServeRegisters(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	regDir := t.TempDir()
	pluginSock, regSock := filepath.Join(regDir, "csi.sock"), filepath.Join(regDir, testDriver+"-reg.sock")
	listenPlugin(t, pluginSock)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, "serve", append([]string{"--endpoint", "unix://" + filepath.Join(dir, "mounter.sock"),
			"--state-dir", dir, "--records-dir", t.TempDir()}, registrationArgs(regDir, pluginSock)...))
	}()
	eventually(t, "the registration socket", func() bool { return socketExists(regSock) })
	wantInfo(t, regSock)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
	if _, err := os.Lstat(regSock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("registration socket left behind: %v", err)
	}
}
