package nri_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// BenchmarkContainerStart measures container start latency (CRI
// CreateContainer + StartContainer through crictl, against the private
// containerd 2) with and without the NRI hook, interleaved in one run,
// median of 20 starts each after one warm-up round:
//
//   - a plain host directory bound at /data: the floor;
//   - the volume published the classic way (ext4 mounted at kubelet's
//     target by the mounter, bound by the runtime): the hook is registered
//     but has nothing to do but look at the mount's source;
//   - the volume in NRI mode: the hook claims it from the plugin and the
//     runtime mounts the ext4 filesystem inside the container.
//
// make bench runs it (hack/bench.sh):
//
//	go test -run '^$' -bench ContainerStart -benchtime 1x ./test/nri
func BenchmarkContainerStart(b *testing.B) {
	const n = 20
	e := newEnv(b, envOptions{noPoller: true})
	pod := e.cri.RunPod(b, "bench")

	classicID, vctx := e.createVolume("bench-classic", mountCap())
	delete(vctx, "nri")
	e.stage(classicID, mountCap(), vctx)
	classic := e.target(pod.UID, "classic", false)
	e.mustPublish(classicID, classic, mountCap(), vctx, publishOptions{})

	nriID, nriCtx := e.createVolume("bench-nri", mountCap())
	e.stage(nriID, mountCap(), nriCtx)
	viaHook := e.target(pod.UID, "nri", false)
	e.mustPublish(nriID, viaHook, mountCap(), nriCtx, publishOptions{})

	plain := filepath.Join(e.kubelet, "plain")
	if err := os.MkdirAll(plain, 0o755); err != nil {
		b.Fatal(err)
	}
	modes := []struct {
		name, target, fsType string
	}{
		{"host directory, no volume", plain, ""},
		{"volume published on the host (no hook)", classic, "ext4"},
		{"volume in NRI mode (hook)", viaHook, "ext4"},
	}
	times := make([][]time.Duration, len(modes))
	for round := range n + 1 {
		for m, mode := range modes {
			start := time.Now()
			id := pod.RunContainer(b, fmt.Sprintf("c%d-%d", m, round), volumeMount("/data", mode.target, false))
			d := time.Since(start)
			if round == 0 && mode.fsType != "" {
				if fsType, _ := e.fsAt(id, "/data"); fsType != mode.fsType {
					b.Fatalf("%s: /data is %q, want %s", mode.name, fsType, mode.fsType)
				}
			}
			e.removeContainer(id)
			if round > 0 {
				times[m] = append(times[m], d)
			}
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ncontainer start latency (crictl create + start), median of %d interleaved starts\n\n", n)
	fmt.Fprintf(&sb, "| container's /data | median ms | p90 ms | median vs. published on the host |\n|---|---|---|---|\n")
	base, _ := quantiles(times[1])
	for m, mode := range modes {
		med, p90 := quantiles(times[m])
		fmt.Fprintf(&sb, "| %s | %.1f | %.1f | %+.1f ms |\n", mode.name, ms(med), ms(p90), ms(med-base))
		b.ReportMetric(ms(med), fmt.Sprintf("ms-median-%d", m))
	}
	create, start := hookTimes(b, e.sidecar.logPath)
	if len(create) < n || len(start) < n {
		b.Fatalf("the sidecar logged %d CreateContainer and %d StartContainer timings, want %d", len(create), len(start), n)
	}
	cm, cp := quantiles(create[1:])
	sm, sp := quantiles(start[1:])
	fmt.Fprintf(&sb, "\nin the hook (the sidecar's log): CreateContainer median %.2f ms (p90 %.2f), StartContainer median %.2f ms (p90 %.2f)\n",
		ms(cm), ms(cp), ms(sm), ms(sp))
	fmt.Print(sb.String())

	if err := pod.Remove(); err != nil {
		b.Fatal(err)
	}
	e.finish(classicID, nil, classic)
	e.finish(nriID, nil, viaHook)
}

// hookTimes reads how long the hook's CreateContainer and StartContainer
// took from the sidecar's log (its "took" values, --v=4).
func hookTimes(tb testing.TB, logPath string) (create, start []time.Duration) {
	tb.Helper()
	b, err := os.ReadFile(logPath)
	if err != nil {
		tb.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		_, v, ok := strings.Cut(l, " took=\"")
		if !ok {
			continue
		}
		v, _, _ = strings.Cut(v, "\"")
		d, err := time.ParseDuration(v)
		if err != nil {
			continue
		}
		switch {
		case strings.Contains(l, "Container gets its volumes"):
			create = append(create, d)
		case strings.Contains(l, "Container starts"):
			start = append(start, d)
		}
	}
	return create, start
}

func quantiles(ds []time.Duration) (median, p90 time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2], s[len(s)*9/10]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
