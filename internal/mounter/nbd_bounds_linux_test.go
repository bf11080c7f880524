package mounter

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/nbdnl"
)

// TestNBDLimit: with a bound of 2, a third ConnectNBD is ResourceExhausted
// before the kernel is asked; once one is disconnected, it succeeds.
func TestNBDLimit(t *testing.T) {
	k := newFakeNBD()
	n := nbdNode(t, k, Bounds(Options{StateDir: t.TempDir(), RecordsDir: t.TempDir()}, 0, 2, 0))
	ctx := context.Background()
	connect := func(vol string) (Device, string, error) {
		b := backendFor(t, vol)
		d, err := n.ConnectNBD(ctx, NBDRequest{SizeBytes: 64 << 20, ServerFlags: nbdnl.FlagHasFlags, Timeout: time.Minute, Backend: b}, streamSocket(t))
		return d, b, err
	}
	var first string
	for i := range 2 {
		_, b, err := connect(fmt.Sprintf("vol-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = b
		}
	}
	d, _, err := connect("vol-2")
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a third NBD device with a limit of 2: %+v, %v; want ResourceExhausted", d, err)
	}
	t.Logf("refused: %v", err)
	if len(k.connects) != 2 {
		t.Fatalf("the kernel was asked for %d connects, want 2: the refused one must not reach it", len(k.connects))
	}
	if err := n.DisconnectNBD(ctx, Device{}, first); err != nil {
		t.Fatal(err)
	}
	if _, _, err := connect("vol-2"); err != nil {
		t.Fatalf("ConnectNBD once a device was disconnected: %v", err)
	}
}
