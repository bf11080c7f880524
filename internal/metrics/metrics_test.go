package metrics

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

func TestNilMetricsRecordNothingAndDoNotPanic(t *testing.T) {
	var m *Metrics
	m.ObserveRPC("/x", codes.OK, time.Millisecond)
	m.DaemonRestarted("sshfs")
	m.Reconciled(nil)
	ran := false
	if err := m.Step("attach", func() error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("Step on nil metrics: ran=%v err=%v", ran, err)
	}
}

func TestScrape(t *testing.T) {
	m := New(func() map[string]int { return map[string]int{"loop": 3} })
	m.ObserveRPC("/csi.v1.Node/NodeStageVolume", codes.Aborted, 3*time.Millisecond)
	wantErr := errors.New("boom")
	if err := m.Step("format", func() error { return wantErr }); !errors.Is(err, wantErr) {
		t.Fatalf("Step lost the error: %v", err)
	}
	m.DaemonRestarted("sshfs")
	m.Reconciled(errors.New("x"))

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	debug := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "debug here") })
	go func() { done <- m.Serve(ctx, lis, map[string]http.Handler{"/debug/x": debug}) }()
	get := func(path string) string {
		resp, err := http.Get("http://" + lis.Addr().String() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body)
	}
	body := get("/metrics")
	if got := get("/debug/x"); got != "debug here" {
		t.Errorf("/debug/x served %q", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("server: %v", err)
	}
	for _, want := range []string{
		`mountplan_rpc_duration_seconds_count{code="Aborted",method="/csi.v1.Node/NodeStageVolume"} 1`,
		`mountplan_step_duration_seconds_count{step="format"} 1`,
		`mountplan_daemon_restarts_total{profile="sshfs"} 1`,
		`mountplan_reconcile_volumes_total{result="error"} 1`,
		`mountplan_staged_volumes{type="loop"} 3`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}
