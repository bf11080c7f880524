package iscsi

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
)

// TestSendTargets discovers a real tgtd target over loopback.
func TestSendTargets(t *testing.T) {
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{16 << 20}})
	targets, err := Discoverer{Portal: tg.Portal, InitiatorName: "iqn.2024-01.io.mountplan.test:node"}.SendTargets(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(targets) != 1 || targets[0].Name != tg.IQN || len(targets[0].Portals) == 0 {
		t.Fatalf("SendTargets = %+v, want %s", targets, tg.IQN)
	}
	if p := targets[0].Portals[0]; p.Address != tg.Portal || p.TPGT != 1 {
		t.Fatalf("portal %+v, want %s,1", p, tg.Portal)
	}
}

func TestSendTargetsUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	_, err = Discoverer{Portal: addr, InitiatorName: "iqn.x:y", Timeout: 2 * time.Second}.SendTargets(context.Background())
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("SendTargets on a closed port = %v, want Unavailable", err)
	}
}
