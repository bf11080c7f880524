package metrics

import (
	"context"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/version"
)

func TestNilMetricsRecordNothingAndDoNotPanic(t *testing.T) {
	var m *Metrics
	m.ObserveRPC("/x", codes.OK, time.Millisecond)
	m.DaemonRestarted("sshfs")
	m.Reconciled(nil)
	m.ObserveStep("daemon_start", errors.New("x"), time.Millisecond)
	m.NodeInfo("node-a")
	m.Preflight(map[string]bool{"fuse": true})
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
	if err := m.Step("format", func() error { return nil }); err != nil {
		t.Fatal(err)
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
		// A step's outcome is a label: failures have a rate of their own.
		`mountplan_step_duration_seconds_count{result="error",step="format"} 1`,
		`mountplan_step_duration_seconds_count{result="ok",step="format"} 1`,
		`mountplan_daemon_restarts_total{profile="sshfs"} 1`,
		`mountplan_reconcile_volumes_total{result="error"} 1`,
		`mountplan_staged_volumes{type="loop"} 3`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

// Which build serves the metrics: one series of value 1 whose labels are
// the build's version, revision and Go version, as --version says them.
func TestBuildInfo(t *testing.T) {
	m := New(nil)
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := version.Get()
	want := map[string]string{"version": v.Version, "revision": v.Revision, "goversion": runtime.Version()}
	for _, mf := range mfs {
		if mf.GetName() != "mountplan_build_info" {
			continue
		}
		if len(mf.GetMetric()) != 1 {
			t.Fatalf("mountplan_build_info has %d series, want 1", len(mf.GetMetric()))
		}
		s := mf.GetMetric()[0]
		got := map[string]string{}
		for _, l := range s.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		if !maps.Equal(got, want) {
			t.Errorf("mountplan_build_info labels %v, want %v", got, want)
		}
		if s.GetGauge().GetValue() != 1 {
			t.Errorf("mountplan_build_info = %v, want 1", s.GetGauge().GetValue())
		}
		return
	}
	t.Fatal("no mountplan_build_info in the scrape")
}

// The node's name as the plugin was started with it (--node-id), on a
// series of its own: dashboards join it on instance to show and select
// nodes by name rather than by the scrape target's address.
func TestNodeInfo(t *testing.T) {
	m := New(nil)
	m.NodeInfo("node-a")
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "mountplan_node_info" {
			continue
		}
		if len(mf.GetMetric()) != 1 {
			t.Fatalf("mountplan_node_info has %d series, want 1", len(mf.GetMetric()))
		}
		s := mf.GetMetric()[0]
		got := map[string]string{}
		for _, l := range s.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		if !maps.Equal(got, map[string]string{"node": "node-a"}) || s.GetGauge().GetValue() != 1 {
			t.Errorf("mountplan_node_info %v = %v, want {node=node-a} 1", got, s.GetGauge().GetValue())
		}
		return
	}
	t.Fatal("no mountplan_node_info in the scrape")
}

func TestPreflightFeatures(t *testing.T) {
	m := New(nil)
	m.Preflight(map[string]bool{"fuse": true, "cgroup2": false})
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, mf := range mfs {
		if mf.GetName() != "mountplan_preflight_feature" {
			continue
		}
		for _, s := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range s.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if s.GetGauge().GetValue() != 1 {
				t.Errorf("%v = %v, want 1", l, s.GetGauge().GetValue())
			}
			got[l["feature"]] = l["available"]
		}
	}
	if want := map[string]string{"fuse": "true", "cgroup2": "false"}; !maps.Equal(got, want) {
		t.Fatalf("mountplan_preflight_feature: %v, want %v", got, want)
	}
}
