package driver

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
)

// logLines is a logger that keeps its lines.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, prefix+" "+args)
	}, funcr.Options{})
}

func (l *logLines) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

func probeReady(t *testing.T, ctx context.Context, d *Driver) bool {
	t.Helper()
	resp, err := d.Probe(ctx, &csi.ProbeRequest{})
	if err != nil {
		t.Fatalf("Probe = %v, want an answer (not-ready is not an error)", err)
	}
	return resp.GetReady().GetValue()
}

// TestProbeAsksTheMounter: with the mounter in another process (the
// chart's way), Probe is ready while the mounter answers on its socket and
// not ready, without an error, once it does not; the reason is logged once
// per change, not at every Probe.
func TestProbeAsksTheMounter(t *testing.T) {
	state := t.TempDir()
	local, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: state, RecordsDir: mounter.DefaultRecordsDir(state)})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	sock := filepath.Join(t.TempDir(), "mounter.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srvCtx, stopServer := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- service.NewServer(klog.Background(), local).Serve(srvCtx, lis) }()
	client := service.NewClient(sock)
	defer client.Close()
	d, err := New(testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "node-a", StateDir: state, KubeletDir: t.TempDir(), Node: client}))
	if err != nil {
		t.Fatal(err)
	}
	d.ready.Store(true) // the startup reconcile's part is not what this tests
	now := time.Now()
	d.mounterProbe.now = func() time.Time { return now }
	var logs logLines
	ctx := klog.NewContext(context.Background(), logs.logger())

	if !probeReady(t, ctx, d) {
		t.Fatal("Probe not ready while the mounter answers")
	}
	stopServer()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	// The last answer is fresh for a while: no call, still ready.
	if !probeReady(t, ctx, d) {
		t.Error("Probe asked the mounter again within the freshness window")
	}
	for range 3 {
		now = now.Add(mounterProbeFresh + time.Millisecond)
		if probeReady(t, ctx, d) {
			t.Fatal("Probe ready while the mounter does not answer")
		}
	}
	if n := logs.count("The mounter does not answer"); n != 1 {
		t.Errorf("the mounter's silence logged %d times over three Probes, want once: %q", n, logs.lines)
	}
}

// pingNode is a mounter in another process whose answers the test sets,
// counting the times it is asked.
type pingNode struct {
	mounter.Node
	calls atomic.Int32
	fail  atomic.Bool
}

func (p *pingNode) Ping(context.Context) error {
	p.calls.Add(1)
	if p.fail.Load() {
		return fmt.Errorf("mounter: LiveNamespaces: reaching /x.sock: connection refused: %w", errdefs.ErrUnavailable)
	}
	return nil
}

// TestProbeCachesMounterAnswer: kubelet's livenessprobe and the
// registrar call Probe every few seconds: the mounter is asked at most once
// per freshness window, and again after it; an answer after a silence is
// logged once as well.
func TestProbeCachesMounterAnswer(t *testing.T) {
	state := t.TempDir()
	opts := testOptions(t, Options{DriverName: "mountplan.csi.io", NodeID: "node-a", StateDir: state, KubeletDir: t.TempDir()})
	node := &pingNode{Node: opts.Node}
	opts.Node = node
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	d.ready.Store(true)
	now := time.Now()
	d.mounterProbe.now = func() time.Time { return now }
	var logs logLines
	ctx := klog.NewContext(context.Background(), logs.logger())
	for range 5 {
		if !probeReady(t, ctx, d) {
			t.Fatal("not ready")
		}
	}
	if n := node.calls.Load(); n != 1 {
		t.Errorf("5 Probes within %v asked the mounter %d times, want 1", mounterProbeFresh, n)
	}
	node.fail.Store(true)
	now = now.Add(mounterProbeFresh + time.Millisecond)
	if probeReady(t, ctx, d) {
		t.Error("ready while the mounter fails")
	}
	node.fail.Store(false)
	now = now.Add(mounterProbeFresh + time.Millisecond)
	for range 2 { // the second from the fresh answer
		if !probeReady(t, ctx, d) {
			t.Error("not ready once the mounter answers again")
		}
	}
	if n := node.calls.Load(); n != 3 {
		t.Errorf("the mounter was asked %d times, want 3", n)
	}
	if a, b := logs.count("The mounter does not answer"), logs.count("The mounter answers again"); a != 1 || b != 1 {
		t.Errorf("logged the silence %d times and the answer %d times, want once each: %q", a, b, logs.lines)
	}
}
