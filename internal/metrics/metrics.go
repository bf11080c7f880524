// Package metrics exposes mountplan's Prometheus metrics. Metrics are off
// unless --metrics-address is given: a nil *Metrics accepts every
// recording call and records nothing, so the code that records needs no
// checks; Serve needs a real one (only a process with an address serves).
package metrics

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/version"
)

const namespace = "mountplan"

// Metrics holds the collectors, in a registry of its own (not the global
// one, so tests can create as many as they like).
type Metrics struct {
	Registry   *prometheus.Registry
	rpc        *prometheus.HistogramVec
	steps      *prometheus.HistogramVec
	restarts   *prometheus.CounterVec
	reconciles *prometheus.CounterVec
}

// New creates the collectors. staged, when not nil, is asked for the
// number of staged volumes by type at each scrape, so the gauge can never
// drift from the journal.
func New(staged func() map[string]int) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		rpc: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "rpc_duration_seconds",
			Help:    "Latency of gRPC calls served by the plugin, by method and status code.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"method", "code"}),
		steps: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "step_duration_seconds",
			Help:    "Duration of device steps (attach, detach, format, mount, daemon_start, nbd_connect, nbd_disconnect, iscsi_login, iscsi_logout), by result (ok, error).",
			Buckets: []float64{.0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5, 30},
		}, []string{"step", "result"}),
		restarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "daemon_restarts_total",
			Help: "Restarts of volume daemons (FUSE) by profile.",
		}, []string{"profile"}),
		reconciles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "reconcile_volumes_total",
			Help: "Volumes visited by the reconciler, by result (ok, error).",
		}, []string{"result"}),
	}
	m.Registry.MustRegister(m.rpc, m.steps, m.restarts, m.reconciles, buildInfo(version.Get()),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if staged != nil {
		m.Registry.MustRegister(stagedCollector{
			desc: prometheus.NewDesc(namespace+"_staged_volumes", "Volumes staged on this node, by type.", []string{"type"}, nil),
			f:    staged,
		})
	}
	return m
}

// buildInfo is the series that says which build serves: value 1, the
// labels --version prints. (collectors.NewBuildInfoCollector says only
// the module's version, "(devel)" for every build from a checkout.)
func buildInfo(v version.Info) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: namespace, Name: "build_info",
		Help:        "The build of the plugin: its version, git revision and Go version; always 1.",
		ConstLabels: prometheus.Labels{"version": v.Version, "revision": v.Revision, "goversion": v.GoVersion},
	}, func() float64 { return 1 })
}

// ObserveRPC records one served call.
func (m *Metrics) ObserveRPC(method string, code codes.Code, d time.Duration) {
	if m != nil {
		m.rpc.WithLabelValues(method, code.String()).Observe(d.Seconds())
	}
}

// ObserveStep records the duration of a device step and its outcome (err
// nil: ok). A failed step is timed too: a failure that takes the whole
// timeout is not one that fails at once.
func (m *Metrics) ObserveStep(step string, err error, d time.Duration) {
	if m != nil {
		m.steps.WithLabelValues(step, result(err)).Observe(d.Seconds())
	}
}

// Step times fn as step.
func (m *Metrics) Step(step string, fn func() error) error {
	start := time.Now()
	err := fn()
	m.ObserveStep(step, err, time.Since(start))
	return err
}

// result is the result label of an outcome.
func result(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

// NodeInfo adds mountplan_node_info{node}, always 1: the node's name as
// the plugin was started with it (--node-id). The scrape's own labels name
// the target by address (a pod IP); a dashboard joins this series on
// instance to select and show nodes by name, with no relabeling in the
// scrape config.
func (m *Metrics) NodeInfo(node string) {
	if m == nil {
		return
	}
	m.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: namespace, Name: "node_info",
		Help:        "The name of the node the plugin serves (its --node-id); always 1.",
		ConstLabels: prometheus.Labels{"node": node},
	}, func() float64 { return 1 }))
}

// Preflight adds mountplan_preflight_feature{feature, available}, always 1:
// what the plugin's preflight found at its start (internal/preflight), so
// that an alert on available="false" names a node's missing feature
// without anyone reading its log.
func (m *Metrics) Preflight(features map[string]bool) {
	if m == nil {
		return
	}
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: "preflight_feature",
		Help: "A kernel feature, module, device or tool the plugin's preflight checked at start, and whether it is available; always 1."},
		[]string{"feature", "available"})
	for f, ok := range features {
		g.WithLabelValues(f, strconv.FormatBool(ok)).Set(1)
	}
	m.Registry.MustRegister(g)
}

// DaemonRestarted counts a restart of a daemon of profile.
func (m *Metrics) DaemonRestarted(profile string) {
	if m != nil {
		m.restarts.WithLabelValues(profile).Inc()
	}
}

// WatchReboot adds the gauges of a reboot the plugin did not see:
// mountplan_started_after_reboot (1 when this process found, at its
// start, that the node had rebooted since the state dir's last run) and
// mountplan_volumes_awaiting_restage (asked at each scrape: volumes whose
// devices and mounts the reboot erased and that kubelet has not staged
// or published again yet).
func (m *Metrics) WatchReboot(rebooted bool, awaiting func() int) {
	if m == nil {
		return
	}
	v := 0.0
	if rebooted {
		v = 1
	}
	m.Registry.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "started_after_reboot",
			Help: "1 when the plugin found at its start that the node had rebooted since its last run."},
			func() float64 { return v }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "volumes_awaiting_restage",
			Help: "Volumes whose devices and mounts a reboot erased and that kubelet has not staged or published again."},
			func() float64 { return float64(awaiting()) }))
}

// Reconciled counts a volume the reconciler visited.
func (m *Metrics) Reconciled(err error) {
	if m != nil {
		m.reconciles.WithLabelValues(result(err)).Inc()
	}
}

// Serve serves /metrics on lis until ctx ends, and beside it each of
// debug's handlers at its path (which must start with /debug/).
func (m *Metrics) Serve(ctx context.Context, lis net.Listener, debug map[string]http.Handler) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	for path, h := range debug {
		if !strings.HasPrefix(path, "/debug/") {
			return fmt.Errorf("metrics: debug handler at %q, outside /debug/", path)
		}
		mux.Handle(path, h)
	}
	return endpoint.ServeHTTP(ctx, lis, mux)
}

type stagedCollector struct {
	desc *prometheus.Desc
	f    func() map[string]int
}

func (c stagedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c stagedCollector) Collect(ch chan<- prometheus.Metric) {
	for typ, n := range c.f() {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), typ)
	}
}
