package metrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"
)

// DaemonUsage is one volume's FUSE daemon as the mounter reads its
// cgroup.
type DaemonUsage struct {
	Volume, Profile string
	// InCgroup: the daemon runs in a cgroup of its own; without one
	// only LimitsEnforced is reported.
	InCgroup bool
	// LimitsEnforced: the profile limits nothing, or its limits apply.
	LimitsEnforced bool
	// HasMemory: the memory controller accounts the cgroup (then
	// MemoryBytes and OOMKills are reported).
	HasMemory   bool
	MemoryBytes uint64
	CPUUsec     uint64
	OOMKills    uint64
}

// daemonScrapeTimeout bounds the question to the mounter at a scrape.
const daemonScrapeTimeout = 2 * time.Second

// AddDaemonUsage registers a collector that asks f, at each scrape and
// never in between, what each volume's daemon uses. An error of f leaves
// the daemons' series out of that scrape (and is logged).
func (m *Metrics) AddDaemonUsage(f func(ctx context.Context) ([]DaemonUsage, error)) {
	if m == nil {
		return
	}
	labels := []string{"volume", "profile"}
	m.Registry.MustRegister(daemonCollector{f: f,
		memory: prometheus.NewDesc(namespace+"_fuse_daemon_memory_bytes",
			"Memory a FUSE daemon's cgroup uses (memory.current), by volume and profile.", labels, nil),
		cpu: prometheus.NewDesc(namespace+"_fuse_daemon_cpu_seconds_total",
			"CPU time a FUSE daemon's cgroup used (cpu.stat usage_usec), every generation of the volume's daemon together.", labels, nil),
		ooms: prometheus.NewDesc(namespace+"_fuse_daemon_oom_kills_total",
			"OOM kills in a FUSE daemon's cgroup at the profile's memory limit (memory.events oom_kill).", labels, nil),
		enforced: prometheus.NewDesc(namespace+"_fuse_daemon_limits_enforced",
			"1 when the profile's resource limits apply to the volume's daemon (or it has none), 0 when they are not enforced (no cgroup v2).", labels, nil),
	})
}

type daemonCollector struct {
	f                           func(ctx context.Context) ([]DaemonUsage, error)
	memory, cpu, ooms, enforced *prometheus.Desc
}

func (c daemonCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.memory
	ch <- c.cpu
	ch <- c.ooms
	ch <- c.enforced
}

func (c daemonCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), daemonScrapeTimeout)
	defer cancel()
	all, err := c.f(ctx)
	if err != nil {
		klog.V(2).InfoS("The FUSE daemons' usage is left out of this scrape", "err", err)
		return
	}
	for _, u := range all {
		lv := []string{u.Volume, u.Profile}
		enforced := 0.0
		if u.LimitsEnforced {
			enforced = 1
		}
		ch <- prometheus.MustNewConstMetric(c.enforced, prometheus.GaugeValue, enforced, lv...)
		if !u.InCgroup {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.cpu, prometheus.CounterValue, float64(u.CPUUsec)/1e6, lv...)
		if u.HasMemory {
			ch <- prometheus.MustNewConstMetric(c.memory, prometheus.GaugeValue, float64(u.MemoryBytes), lv...)
			ch <- prometheus.MustNewConstMetric(c.ooms, prometheus.CounterValue, float64(u.OOMKills), lv...)
		}
	}
}
