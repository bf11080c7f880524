package metrics

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestDaemonUsage: the collector asks at each scrape, reports a daemon
// with a memory-accounted cgroup in full, one without a cgroup only as
// not enforced, and nothing when the mounter cannot answer.
func TestDaemonUsage(t *testing.T) {
	m := New(nil)
	calls := 0
	var fail error
	m.AddDaemonUsage(func(context.Context) ([]DaemonUsage, error) {
		calls++
		if fail != nil {
			return nil, fail
		}
		return []DaemonUsage{
			{Volume: "v1", Profile: "rclone", InCgroup: true, LimitsEnforced: true, HasMemory: true, MemoryBytes: 1 << 20, CPUUsec: 2500000, OOMKills: 3},
			{Volume: "v2", Profile: "sshfs", LimitsEnforced: false},
		}, nil
	})
	got := scrape(t, m)
	want := map[string]float64{
		"mountplan_fuse_daemon_cpu_seconds_total{profile=rclone,volume=v1}": 2.5,
		"mountplan_fuse_daemon_memory_bytes{profile=rclone,volume=v1}":      1 << 20,
		"mountplan_fuse_daemon_oom_kills_total{profile=rclone,volume=v1}":   3,
		"mountplan_fuse_daemon_limits_enforced{profile=rclone,volume=v1}":   1,
		"mountplan_fuse_daemon_limits_enforced{profile=sshfs,volume=v2}":    0,
	}
	if len(got) != len(want) {
		t.Errorf("scrape = %v, want %v", got, want)
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %t), want %v", k, g, ok, v)
		}
	}
	if calls != 1 {
		t.Errorf("asked %d times for one scrape", calls)
	}
	fail = errors.New("mounter away")
	if got := scrape(t, m); len(got) != 0 {
		t.Errorf("a scrape while the mounter cannot answer: %v", got)
	}
	var off *Metrics
	off.AddDaemonUsage(nil) // metrics off: accepted, nothing done
}

// scrape gathers the fuse_daemon series as name{label=value,...} → value.
func scrape(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "mountplan_fuse_daemon") {
			continue
		}
		for _, mt := range mf.GetMetric() {
			key := mf.GetName() + "{"
			for i, l := range mt.GetLabel() {
				if i > 0 {
					key += ","
				}
				key += l.GetName() + "=" + l.GetValue()
			}
			key += "}"
			v := mt.GetGauge().GetValue()
			if mt.GetCounter() != nil {
				v = mt.GetCounter().GetValue()
			}
			out[key] = v
		}
	}
	return out
}
