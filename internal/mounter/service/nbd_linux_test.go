//go:build linux

package service_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
)

// TestNBDThroughTheSocket: the NBD calls cross the socket with their
// descriptor, and the mounter's refusals come back with their sentinels.
// The kernel's part is make test-vm's (this one may lack nbd): here a
// request the mounter accepts reaches the kernel and, without the nbd
// module, is FailedPrecondition naming it.
func TestNBDThroughTheSocket(t *testing.T) {
	c := serve(t, t.TempDir())
	ctx := context.Background()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	sock, peer := os.NewFile(uintptr(fds[0]), "nbd"), os.NewFile(uintptr(fds[1]), "server")
	defer sock.Close()
	defer peer.Close()
	backend, err := mounter.NewNBDBackend("vol")
	if err != nil {
		t.Fatal(err)
	}
	req := mounter.NBDRequest{SizeBytes: 16 << 20, BlockSize: 4096, Timeout: 10 * time.Second, Backend: backend}

	if _, err := c.ConnectNBD(ctx, req, nil); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "no socket") {
		t.Fatalf("ConnectNBD without a socket: %v, want InvalidArgument", err)
	}
	bad := req
	bad.Backend = "rbd-nbd:pool/img"
	if _, err := c.ConnectNBD(ctx, bad, sock); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("ConnectNBD with another driver's backend: %v, want InvalidArgument", err)
	}
	if err := c.ReconnectNBD(ctx, mounter.Device{}, backend, sock); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("ReconnectNBD of a backend never connected: %v, want NotFound", err)
	}
	if err := c.DisconnectNBD(ctx, mounter.Device{}, backend); err != nil {
		t.Fatalf("DisconnectNBD of a backend never connected: %v", err)
	}
	if _, err := os.Stat("/sys/module/nbd"); err == nil {
		t.Log("this kernel has nbd: the connect itself is make test-vm's")
	} else if _, err := c.ConnectNBD(ctx, req, sock); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "modprobe nbd") {
		t.Fatalf("ConnectNBD on a kernel without nbd: %v, want FailedPrecondition naming modprobe nbd", err)
	}
	// The caller's descriptor is its own still: the mounter closed its copy.
	if _, err := sock.Write([]byte("x")); err != nil {
		t.Fatalf("the caller's socket after the calls: %v", err)
	}
}
