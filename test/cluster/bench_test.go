//go:build clustertest

package cluster

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// envBench makes TestCluster run the pod start-up benchmark instead of the
// flows (make bench-cluster); envBenchPods is its pods per mode (30 per
// node: 90 on the three nodes).
const (
	envBench     = "MOUNTPLAN_CLUSTER_BENCH"
	envBenchPods = "MOUNTPLAN_CLUSTER_BENCH_PODS"
	benchNS      = "mp-bench"
)

// benchMode is one round of the benchmark: pods started at once, each with
// claims fresh claims of class, or with an emptyDir when claims is 0.
type benchMode struct {
	name   string
	pods   int
	claims int
	class  string
}

// benchResult is what a round measured.
type benchResult struct {
	mode     benchMode
	running  []time.Duration // per pod: created → Running
	bound    []time.Duration // per claim: created → Bound
	warnings map[string]int  // Warning events by reason
	busy     float64         // the machine's CPUs busy, from the first creation to the last pod Running
	calls    []rpcTime       // the plugin's gRPC calls during the round
}

// rpcTime is the plugin's own account of one method's calls.
type rpcTime struct {
	method  string
	calls   uint64
	aborted uint64 // answered Aborted (an operation on the volume in flight): kubelet retries
	total   time.Duration
}

// benchPodStartup starts each mode's pods at once and measures, from the
// API server's watch as a client sees it, how long each pod takes from its
// creation to Running and each claim from its creation to Bound. After
// each round the namespace is deleted and the node must hold no more
// records, images or loop devices than before it. It writes the table and a
// plot under bench-results/; it asserts correctness only, never a time.
func benchPodStartup(t *testing.T, e *env) {
	nodes := len(e.c.nodes())
	n := 30 * nodes
	if v := os.Getenv(envBenchPods); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("%s=%q: want a positive number", envBenchPods, v)
		}
	}
	e.apply(t, e.nriStorageClass())
	modes := []benchMode{
		{name: "emptyDir", pods: n},
		{name: "claim", pods: n, claims: 1, class: storageClass},
		{name: "NRI claim", pods: n, claims: 1, class: nriClass},
		{name: "one pod, 20 claims", pods: 1, claims: 20, class: storageClass},
	}
	var results []benchResult
	for _, m := range modes {
		r := e.benchRound(t, m)
		if t.Failed() {
			return
		}
		results = append(results, r)
	}
	table := benchTable(results)
	t.Logf("pod start-up, %d pods per round on %d nodes:\n%s", n, nodes, table)
	dir := filepath.Join(e.repo, "bench-results")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	header := fmt.Sprintf("# Pod start-up (make bench-cluster, %s)\n\n%d pods per round, started at once on %d nodes (one machine's two CPUs); times from each object's creation as the API server's watch shows it.\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), n, nodes)
	if err := os.WriteFile(filepath.Join(dir, "pod-startup.md"), []byte(header+table), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pod-startup.svg"), []byte(benchPlot(results)), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("written: %s/pod-startup.md, pod-startup.svg", dir)
	e.keepBenchLogs(t, filepath.Join(dir, "logs"))
}

// keepBenchLogs copies each node's logs (containerd's and kubelet's, and
// on the first node the control plane's) and the logs of mountplan's pods
// there (what a round's Warning events and waits need explaining by) to
// dir/<node>: a passing run removes the cluster's directory.
func (e *env) keepBenchLogs(t *testing.T, dir string) {
	t.Helper()
	_ = os.RemoveAll(dir)
	for _, n := range e.c.nodes() {
		to := filepath.Join(dir, n.cfg.name())
		if err := os.MkdirAll(to, 0o755); err != nil {
			t.Fatal(err)
		}
		logs, err := filepath.Glob(n.cfg.path("logs", "*.log"))
		if err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("cp", append(append([]string{"-r"}, logs...), n.cfg.path("logs", "pods"), to)...).CombinedOutput()
		if err != nil {
			t.Errorf("keeping %s's logs: %v: %s", n.cfg.name(), err, out)
		}
	}
	t.Logf("each node's logs and mountplan's pods' logs: %s", dir)
}

// benchRound runs one mode.
func (e *env) benchRound(t *testing.T, m benchMode) benchResult {
	t.Helper()
	before := e.volumesOnNode(t)
	must(t)(e.c.kubectl("create", "namespace", benchNS))
	ctx, cancel := context.WithCancel(context.Background())
	pods := e.watchTimes(ctx, t, "pods", func(o watchObject) bool { return o.Status.Phase == "Running" })
	claims := e.watchTimes(ctx, t, "pvc", func(o watchObject) bool { return o.Status.Phase == "Bound" })
	sleep(2 * time.Second) // both watches established before the first creation

	var objs []obj
	for p := 0; p < m.pods; p++ {
		name := fmt.Sprintf("b%d", p)
		var opts []podOpt
		for c := 0; c < m.claims; c++ {
			claim := fmt.Sprintf("%s-%d", name, c)
			o := pvc(claim, m.class, "64Mi")
			o["metadata"].(obj)["namespace"] = benchNS
			objs = append(objs, o)
			opts = append(opts, withClaim(claim, fmt.Sprintf("/data/%d", c), false))
		}
		if m.claims == 0 {
			opts = append(opts, func(spec, ctr obj) {
				addVolume(spec, obj{"name": "scratch", "emptyDir": obj{}})
				addMount(ctr, obj{"name": "scratch", "mountPath": "/data"})
			})
		}
		o := pod(name, opts...)
		o["metadata"].(obj)["namespace"] = benchNS
		objs = append(objs, o)
	}
	rpcBefore := e.pluginRPCs(t)
	cpuBefore := cpuTimes(t)
	e.apply(t, obj{"apiVersion": "v1", "kind": "List", "items": objs})
	waitFor(t, 10*time.Minute, fmt.Sprintf("%d pods of round %q Running", m.pods, m.name), func() error {
		if got := pods.done(); got < m.pods {
			return fmt.Errorf("%d Running", got)
		}
		return nil
	})
	busy := cpuBusy(cpuBefore, cpuTimes(t))
	cancel()
	// mountplan's containers restarted during the round would explain
	// Warning events of its volumes.
	restarts := must(t)(e.c.kubectl("-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=mountplan", "-o",
		`jsonpath={range .items[*]}{.spec.nodeName}/{.metadata.name}:{range .status.containerStatuses[*]}{" "}{.name}={.restartCount}{end}{"\n"}{end}`))
	t.Logf("round %q: mountplan's containers' restart counts after it:\n%s", m.name, restarts)
	perNode := map[string]int{}
	for _, n := range strings.Fields(must(t)(e.c.kubectl("-n", benchNS, "get", "pods", "-o", `jsonpath={.items[*].spec.nodeName}`))) {
		perNode[n]++
	}
	r := benchResult{mode: m, running: pods.durations(), bound: claims.durations(), warnings: e.warnings(t), busy: busy,
		calls: rpcDelta(rpcBefore, e.pluginRPCs(t))}
	if len(r.bound) != m.pods*m.claims {
		t.Errorf("round %q: %d claims seen Bound, want %d", m.name, len(r.bound), m.pods*m.claims)
	}
	// The plugin answers Aborted while an operation on the same volume is
	// in flight, and kubelet retries. Under this load a method may answer
	// it at most as often as the round has volumes: once per volume on
	// average (the metrics do not say which volume).
	for _, c := range r.calls {
		if c.aborted > uint64(m.pods*m.claims) {
			t.Errorf("round %q: %s answered Aborted %d times for %d volumes", m.name, c.method, c.aborted, m.pods*m.claims)
		}
	}
	t.Logf("round %q: created → Running p50 %v p99 %v; pods per node %v; CPUs %.0f%% busy; warnings %v; the plugins' calls: %v",
		m.name, pct(r.running, 50), pct(r.running, 99), perNode, 100*r.busy, r.warnings, r.calls)

	// Tear down: the namespace, then every volume of its claims.
	must(t)(e.c.kubectl("delete", "namespace", benchNS, "--timeout=5m"))
	waitFor(t, 5*time.Minute, "the round's volumes deleted", func() error {
		out, err := e.c.kubectl("get", "pv", "-o", `jsonpath={range .items[?(@.spec.claimRef.namespace=="`+benchNS+`")]}{.metadata.name} {end}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "" {
			return fmt.Errorf("left: %s", out)
		}
		if now := e.volumesOnNode(t); now != before {
			return fmt.Errorf("on the node: %s; before the round: %s", now, before)
		}
		return nil
	})
	return r
}

// volumesOnNode counts what each node holds of its volumes: the plugin's
// journal records, the mounter's records, volume images and the loop
// devices backed by a file of the node. (The NRI guard, the mounter's
// own, stays while the plugin runs.)
func (e *env) volumesOnNode(t *testing.T) string {
	t.Helper()
	count := func(dir string) int {
		n := 0
		_ = filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				n++
			}
			return nil
		})
		return n
	}
	var each []string
	for _, n := range e.c.nodes() {
		state := e.c.cfg.path("state")
		each = append(each, fmt.Sprintf("%s: %d journal records, %d mounter records, %d images, %d loop devices", n.cfg.name(),
			count(n.seen(filepath.Join(state, "volumes"))), count(n.seen(state+"-mounter")), count(n.seen(filepath.Join(state, "images"))), len(e.c.loopsOf(n))))
	}
	return strings.Join(each, "; ")
}

// watchObject is what the watches read of a pod or a claim.
type watchObject struct {
	Metadata struct{ Name string }
	Status   struct{ Phase string }
}

// watchTimes follows a kind in the bench namespace and records, per object,
// when it was first seen and when it was first seen at its goal.
type watchTimes struct {
	mu      sync.Mutex
	created map[string]time.Time
	reached map[string]time.Time
}

func (e *env) watchTimes(ctx context.Context, t *testing.T, kind string, reached func(watchObject) bool) *watchTimes {
	t.Helper()
	w := &watchTimes{created: map[string]time.Time{}, reached: map[string]time.Time{}}
	cmd := e.c.nodeCommand(ctx, "kubectl", "-n", benchNS, "get", kind, "--watch", "--output-watch-events", "-o", "json")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer func() { _ = cmd.Wait() }()
		dec := json.NewDecoder(bufio.NewReader(out))
		for {
			var ev struct {
				Type   string
				Object watchObject
			}
			if err := dec.Decode(&ev); err != nil {
				return
			}
			now, name := time.Now(), ev.Object.Metadata.Name
			w.mu.Lock()
			if _, ok := w.created[name]; !ok {
				w.created[name] = now
			}
			if _, ok := w.reached[name]; !ok && ev.Type != "DELETED" && reached(ev.Object) {
				w.reached[name] = now
			}
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *watchTimes) done() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.reached)
}

func (w *watchTimes) durations() []time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	var d []time.Duration
	for name, at := range w.reached {
		d = append(d, at.Sub(w.created[name]))
	}
	slices.Sort(d)
	return d
}

// warnings counts the Warning events of the bench namespace by reason.
func (e *env) warnings(t *testing.T) map[string]int {
	t.Helper()
	out := must(t)(e.c.kubectl("-n", benchNS, "get", "events", "--field-selector", "type=Warning",
		"-o", `jsonpath={range .items[*]}{.reason} {.count} {.involvedObject.kind}/{.involvedObject.name}: {.message}{"\n"}{end}`))
	w := map[string]int{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		n, err := strconv.Atoi(f[1])
		if err != nil || n < 1 {
			n = 1
		}
		if w[f[0]] == 0 {
			t.Logf("first Warning %s", l)
		}
		w[f[0]] += n
	}
	return w
}

// pct is the p-th percentile (nearest rank) of sorted durations.
func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(d)))) - 1
	return d[max(0, min(i, len(d)-1))]
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// benchTable is the results as a Markdown table, with the goals of the
// claim rounds against the emptyDir round and each other.
func benchTable(rs []benchResult) string {
	var b strings.Builder
	b.WriteString("| round | pods | claims | created → Running p50 | p99 | max | p99 / emptyDir p99 | created → Bound p50 | p99 | max | CPUs busy | Warning events |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	var base, classic, nri time.Duration
	for _, r := range rs {
		p99 := pct(r.running, 99)
		switch r.mode.name {
		case "emptyDir":
			base = p99
		case "claim":
			classic = p99
		case "NRI claim":
			nri = p99
		}
		ratio := "-"
		if base > 0 {
			ratio = fmt.Sprintf("%.2f×", p99.Seconds()/base.Seconds())
		}
		bound := [3]string{"-", "-", "-"}
		if len(r.bound) > 0 {
			bound = [3]string{secs(pct(r.bound, 50)), secs(pct(r.bound, 99)), secs(r.bound[len(r.bound)-1])}
		}
		warn := "none"
		if len(r.warnings) > 0 {
			var ws []string
			for reason, n := range r.warnings {
				ws = append(ws, fmt.Sprintf("%s %d", reason, n))
			}
			slices.Sort(ws)
			warn = strings.Join(ws, ", ")
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %.0f %% | %s |\n", r.mode.name, r.mode.pods, r.mode.pods*r.mode.claims,
			secs(pct(r.running, 50)), secs(p99), secs(r.running[len(r.running)-1]), ratio, bound[0], bound[1], bound[2], 100*r.busy, warn)
	}
	met := func(ok bool) string {
		if ok {
			return "met"
		}
		return "not met"
	}
	b.WriteString("\nThe plugin's own time per call (its mountplan_rpc_duration_seconds over the round):\n")
	for _, r := range rs {
		var cs []string
		for _, c := range r.calls {
			cs = append(cs, c.String())
		}
		if len(cs) == 0 {
			cs = []string{"none"}
		}
		fmt.Fprintf(&b, "- %s: %s\n", r.mode.name, strings.Join(cs, ", "))
	}
	b.WriteString("\nGoals:\n")
	fmt.Fprintf(&b, "- a pod with a new claim, p99 ≤ 5 s: %s (%s); ≤ 2× the emptyDir pods' p99: %s (%.2f×)\n",
		met(classic <= 5*time.Second), secs(classic), met(base > 0 && classic <= 2*base), classic.Seconds()/base.Seconds())
	fmt.Fprintf(&b, "- the NRI class within 1.1× of the classic class (p99): %s (%.2f×)\n",
		met(classic > 0 && nri.Seconds() <= 1.1*classic.Seconds()), nri.Seconds()/classic.Seconds())
	return b.String()
}

// benchPlot draws each round's created → Running times as a cumulative
// distribution, in SVG.
func benchPlot(rs []benchResult) string {
	const w, h, left, bottom, top, right = 720.0, 420.0, 60.0, 50.0, 20.0, 180.0
	var most time.Duration
	for _, r := range rs {
		most = max(most, r.running[len(r.running)-1])
	}
	xmax := math.Ceil(most.Seconds())
	x := func(s float64) float64 { return left + s/xmax*(w-left-right) }
	y := func(f float64) float64 { return h - bottom - f*(h-bottom-top) }
	colors := []string{"#555555", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<path d="M%.1f %.1f V%.1f H%.1f" stroke="black" fill="none"/>`+"\n", x(0), y(1), y(0), x(xmax))
	for s := 0.0; s <= xmax; s += math.Max(1, math.Ceil(xmax/10)) {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%g</text>`+"\n", x(s), y(0)+16, s)
	}
	for _, f := range []float64{0, 0.5, 0.99} {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%g</text>`+"\n", x(0)-6, y(f)+4, f)
		fmt.Fprintf(&b, `<path d="M%.1f %.1f H%.1f" stroke="#dddddd"/>`+"\n", x(0), y(f), x(xmax))
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">seconds from creation to Running</text>`+"\n", x(xmax/2), h-12)
	fmt.Fprintf(&b, `<text x="14" y="%.1f" transform="rotate(-90 14 %.1f)" text-anchor="middle">fraction of pods</text>`+"\n", y(0.5), y(0.5))
	for i, r := range rs {
		c := colors[i%len(colors)]
		var path strings.Builder
		fmt.Fprintf(&path, "M%.1f %.1f", x(0), y(0))
		for j, d := range r.running {
			fmt.Fprintf(&path, " H%.1f V%.1f", x(d.Seconds()), y(float64(j+1)/float64(len(r.running))))
		}
		fmt.Fprintf(&b, `<path d="%s" stroke="%s" stroke-width="2" fill="none"/>`+"\n", path.String(), c)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" fill="%s">%s (%d)</text>`+"\n", w-right+10, top+16+float64(i)*18, c, r.mode.name, len(r.running))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// pluginRPCs reads every node's plugin's mountplan_rpc_duration_seconds
// (count and sum per method, every code, summed over the nodes) from its
// metrics port, through the API server's proxy.
func (e *env) pluginRPCs(t *testing.T) map[string]rpcTime {
	t.Helper()
	rpcs := map[string]rpcTime{}
	for _, n := range e.c.nodes() {
		out := must(t)(e.c.kubectl("get", "--raw", fmt.Sprintf("/api/v1/namespaces/kube-system/pods/%s:%d/proxy/metrics", e.podOn(t, nodeComponent, n.cfg.name()), metricsPort)))
		addRPCs(t, rpcs, out)
	}
	return rpcs
}

// addRPCs adds the calls of one plugin's metrics to rpcs.
func addRPCs(t *testing.T, rpcs map[string]rpcTime, metrics string) {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(strings.NewReader(metrics))
	if err != nil {
		t.Fatalf("the plugin's metrics: %v", err)
	}
	f := families["mountplan_rpc_duration_seconds"]
	if f == nil {
		t.Fatal("the plugin exports no mountplan_rpc_duration_seconds")
	}
	for _, m := range f.GetMetric() {
		var method, code string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "method":
				method = l.GetValue()[strings.LastIndex(l.GetValue(), "/")+1:]
			case "code":
				code = l.GetValue()
			}
		}
		r := rpcs[method]
		r.method = method
		r.calls += m.GetHistogram().GetSampleCount()
		if code == "Aborted" {
			r.aborted += m.GetHistogram().GetSampleCount()
		}
		r.total += time.Duration(m.GetHistogram().GetSampleSum() * float64(time.Second))
		rpcs[method] = r
	}
}

// rpcDelta is what the plugin served between two readings, the methods
// it spent most time in first.
func rpcDelta(before, after map[string]rpcTime) []rpcTime {
	var d []rpcTime
	for method, a := range after {
		b := before[method]
		if a.calls > b.calls {
			d = append(d, rpcTime{method: method, calls: a.calls - b.calls, aborted: a.aborted - b.aborted, total: a.total - b.total})
		}
	}
	slices.SortFunc(d, func(x, y rpcTime) int { return int(y.total - x.total) })
	return d
}

func (r rpcTime) String() string {
	s := fmt.Sprintf("%s %d× mean %v", r.method, r.calls, (r.total / time.Duration(r.calls)).Round(time.Millisecond))
	if r.aborted > 0 {
		s += fmt.Sprintf(" (%d Aborted)", r.aborted)
	}
	return s
}

// cpuTimes reads the machine's busy and total CPU time (clock ticks).
func cpuTimes(t *testing.T) [2]uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		t.Fatal(err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	var busy, total uint64
	for i, f := range strings.Fields(line)[1:] {
		n, _ := strconv.ParseUint(f, 10, 64)
		if i == 8 || i == 9 { // guest time is already counted in user time
			continue
		}
		total += n
		if i != 3 && i != 4 { // idle, iowait
			busy += n
		}
	}
	return [2]uint64{busy, total}
}

func cpuBusy(before, after [2]uint64) float64 {
	if after[1] <= before[1] {
		return 0
	}
	return float64(after[0]-before[0]) / float64(after[1]-before[1])
}
