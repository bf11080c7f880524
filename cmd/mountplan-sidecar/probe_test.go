//go:build linux

package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// startServe runs serve on a socket of its own and waits until it accepts;
// stop ends it and waits for it.
func startServe(t *testing.T) (sock string, stop func()) {
	t.Helper()
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	sock = filepath.Join(dir, "mounter.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, "serve", []string{"--endpoint", "unix://" + sock, "--state-dir", dir, "--records-dir", t.TempDir()})
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if conn, err := net.Dial("unix", sock); err == nil {
			conn.Close()
			break
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("serve did not listen on %s: %v", sock, <-done)
		}
	}
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
		}
	}
	t.Cleanup(stop)
	return sock, stop
}

// TestProbeCommand: probe answers nil (exit 0) while serve answers on its
// socket, and an error that names the socket and says why (exit 1, not the
// usage error's 2) once it does not: a socket nobody serves, a stale socket
// file, a server that accepts and never answers.
func TestProbeCommand(t *testing.T) {
	sock, stop := startServe(t)
	var out bytes.Buffer
	if err := runProbe(context.Background(), []string{"--mounter-endpoint", "unix://" + sock}, &out); err != nil {
		t.Fatalf("probe of a live serve: %v", err)
	}
	if !strings.Contains(out.String(), "answered") || strings.Count(out.String(), "\n") != 1 {
		t.Errorf("probe of a live serve printed %q, want one line saying it answered", out.String())
	}
	stop()

	stale := filepath.Join(t.TempDir(), "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	hung := filepath.Join(t.TempDir(), "hung.sock")
	hl, err := net.Listen("unix", hung)
	if err != nil {
		t.Fatal(err)
	}
	defer hl.Close()
	go func() {
		for {
			c, err := hl.Accept()
			if err != nil {
				return
			}
			defer c.Close() // holds it open, answers nothing
		}
	}()
	for name, path := range map[string]string{"gone": sock, "stale": stale, "hung": hung} {
		t.Run(name, func(t *testing.T) {
			var out bytes.Buffer
			start := time.Now()
			err := runProbe(context.Background(), []string{"--mounter-endpoint", "unix://" + path, "--timeout", "300ms"}, &out)
			if err == nil {
				t.Fatalf("probe of a mounter that does not answer passed: %q", out.String())
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("probe took %v with --timeout 300ms", took)
			}
			if errors.Is(err, errUsage) || !errors.Is(err, errdefs.ErrUnavailable) {
				t.Errorf("probe = %v, want Unavailable (exit 1), not a usage error", err)
			}
			if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "does not answer") || strings.Contains(msg, "\n") {
				t.Errorf("probe's reason %q: want one line naming %s and saying it does not answer", msg, path)
			}
		})
	}
}

// TestProbeExitStatus: the binary exits 0 with a live serve, and 1 with
// a one-line reason on stderr once serve is gone (kubelet's exec probe
// reads nothing but the status).
func TestProbeExitStatus(t *testing.T) {
	sock, stop := startServe(t)
	bin := filepath.Join(t.TempDir(), "mountplan-sidecar")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	probe := func() (int, string) {
		var stderr bytes.Buffer
		cmd := exec.Command(bin, "probe", "--mounter-endpoint", "unix://"+sock, "--timeout", "1s")
		cmd.Stderr = &stderr
		err := cmd.Run()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatal(err)
		}
		return cmd.ProcessState.ExitCode(), stderr.String()
	}
	if code, stderr := probe(); code != 0 {
		t.Fatalf("probe of a live serve exited %d: %s", code, stderr)
	}
	stop()
	code, stderr := probe()
	if code != 1 || strings.Count(stderr, "\n") != 1 || !strings.HasPrefix(stderr, "mountplan-sidecar probe: ") {
		t.Fatalf("probe of a gone serve exited %d with %q, want 1 and one line", code, stderr)
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatal(err)
	}
}
