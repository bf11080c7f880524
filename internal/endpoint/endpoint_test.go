package endpoint

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestListen(t *testing.T) {
	staleGrace = 300 * time.Millisecond
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	live := filepath.Join(dir, "live.sock")
	ll, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Close()
	// A listener that goes within the grace, as one that a killed
	// process's child holds until it execs.
	dying := filepath.Join(dir, "dying.sock")
	dl, err := net.Listen("unix", dying)
	if err != nil {
		t.Fatal(err)
	}
	dl.(*net.UnixListener).SetUnlinkOnClose(false)
	time.AfterFunc(staleGrace/3, func() { dl.Close() })
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		endpoint string
		want     error
	}{
		{"unix://" + dying, nil}, // first: it must still be listening
		{"unix://" + stale, nil},
		{"unix://" + filepath.Join(dir, "new.sock"), nil},
		{"unix://" + live, errdefs.ErrAlreadyExists},
		{"unix://" + file, errdefs.ErrFailedPrecondition},
		{"tcp://127.0.0.1:1", errdefs.ErrInvalidArgument},
		{"unix://relative.sock", errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		l, err := Listen(tt.endpoint)
		if !errors.Is(err, tt.want) {
			t.Errorf("Listen(%s) = %v, want %v", tt.endpoint, err, tt.want)
		}
		if err != nil {
			continue
		}
		fi, err := os.Stat(l.Addr().String())
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("socket %s: %v, mode %v, want 0600", l.Addr(), err, fi.Mode())
		}
		l.Close()
	}
}
