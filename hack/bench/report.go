package main

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// row is one line of the summary: an operation, its latency, its ratio to
// what it is compared with, and the goal that ratio is held to.
type row struct {
	Operation string  `json:"operation"`
	N         int     `json:"n"` // timed iterations
	P50ms     float64 `json:"p50_ms"`
	P99ms     float64 `json:"p99_ms"`
	Ratio     float64 `json:"ratio,omitempty"` // p50 / the p50 of RatioTo
	RatioTo   string  `json:"ratio_to,omitempty"`
	Goal      string  `json:"goal,omitempty"`
	Verdict   string  `json:"verdict"` // "met", "not met", "–" (no goal) or why it is not measured
	// Value is a figure that is no latency (a total time, a size, a
	// share of a core), shown in the p50 column.
	Value string `json:"value,omitempty"`
}

// goal is a ratio goal of issue 13 that a measurement is held to.
type goal struct {
	of, to   int // sample numbers: of's p50 / to's p50
	label    string
	toLabel  string
	maxRatio float64
	// pair: a comparison of two socket cycles (of against to), shown as
	// the difference of their p50 and p99 and the ratio of their p50.
	pair bool
	// alone: for a split cycle, the sample of the same cycle with the
	// mounter in process, which a missed goal is told against: what the
	// hop to the mounter adds and what the plugin's own work does.
	alone int
}

// maxSlowdown is the goal for the split: the publish cycle not
// slower than before by more than 10%.
const maxSlowdown = 1.1

// maxOverLean is issue 23's goal: a plugin's publish and prepare cycles
// within 1.2× of the lean CSI node server's, which pays the same kernel
// work and the same transport.
const maxOverLean = 1.2

// rowsOf are the summary's operations in order; maxRatio 0 means no goal.
// Rows of samples this run does not have are left out.
func (r *results) rowsOf() []goal {
	label := func(n int) string {
		if s := r.byN(n); s != nil && s.in != nil {
			return s.in.label
		}
		return r.shape
	}
	main, alone, before, lean := label(1), label(nAlonePublish), r.before, label(nLeanPublish)
	return []goal{
		{of: 1, to: 2, label: "publish cycle via socket (stage, publish, unpublish, unstage), " + main, toLabel: "floor", maxRatio: 1.5},
		{of: nAlonePublish, to: 2, label: "the same, " + alone, toLabel: "floor"},
		{of: nBeforePublish, to: 2, label: "the same, " + before, toLabel: "floor"},
		{of: 1, to: nBeforePublish, label: "publish cycle, now against before: " + main + " against " + before, toLabel: "before", maxRatio: maxSlowdown, pair: true},
		{of: nAlonePublish, to: nBeforePublish, label: "publish cycle, now alone against before (the changes beside the hop): " + alone + " against " + before, toLabel: "before", pair: true},
		{of: 1, to: nAlonePublish, label: "the hop to the mounter, publish cycle: " + main + " against " + alone, toLabel: "alone", pair: true},
		{of: nLeanPublish, to: 2, label: "the same, " + lean + ": the floor plus the transport", toLabel: "floor"},
		{of: 1, to: nLeanPublish, label: "the plugin's own cost, publish cycle: " + main + " against the " + lean, toLabel: "lean", maxRatio: maxOverLean, pair: true, alone: nAlonePublish},
		{of: nAlonePublish, to: nLeanPublish, label: "the plugin's own cost, publish cycle: " + alone + " against the " + lean, toLabel: "lean", maxRatio: maxOverLean, pair: true},
		{of: 2, label: "floor: attach, mount, umount, detach (direct syscalls)"},
		{of: 3, to: 2, label: "the same with util-linux tools", toLabel: "floor"},
		{of: 4, to: 5, label: "prepare cycle via socket (stage, prepare, mount in ns, unmount, unprepare, unstage), " + main, toLabel: "prepare floor"},
		{of: nAlonePrepare, to: 5, label: "the same, " + label(nAlonePrepare) + " (the observing mounter's start not counted)", toLabel: "prepare floor"},
		{of: 4, to: nAlonePrepare, label: "the hop to the mounter, prepare cycle: " + main + " against " + label(nAlonePrepare), toLabel: "alone", pair: true},
		{of: nLeanPrepare, to: 5, label: "the same, " + label(nLeanPrepare) + " (the plan performed in process)", toLabel: "prepare floor"},
		{of: 4, to: nLeanPrepare, label: "the plugin's own cost, prepare cycle: " + main + " against the " + label(nLeanPrepare), toLabel: "lean", maxRatio: maxOverLean, pair: true, alone: nAlonePrepare},
		{of: nAlonePrepare, to: nLeanPrepare, label: "the plugin's own cost, prepare cycle: " + label(nAlonePrepare) + " against the " + label(nLeanPrepare), toLabel: "lean", maxRatio: maxOverLean, pair: true},
		{of: 5, label: "prepare floor: attach, fsmount, setns, move_mount, umount, detach"},
		{of: 6, label: "CreateVolume, 64 MiB ext4"},
		{of: 7, to: 8, label: "first stage of a freshly created volume", toLabel: "later stage", maxRatio: 2},
		{of: 8, label: "later stage of the same volume"},
		{of: 9, label: "DeleteVolume of an unstaged volume"},
	}
}

// scaleGoals are the goals of issue 13 that measurement 8 measures, shown
// as not measured when it did not run.
var scaleGoals = []row{
	{Operation: "every per-volume operation at 10,000 staged volumes", Goal: "≤ 1.2× at 10"},
	{Operation: "teardown of 1,000 volumes, 8 clients", Goal: "≤ 10 s"},
	{Operation: "restart with 10,000 staged volumes", Goal: "ready ≤ 1 s, RSS ≤ 50 MiB, reconcile ≤ 1 % of a core"},
}

func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[max(int(math.Ceil(0.99*float64(len(s))))-1, 0)]
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// summary is the rows of the samples this run has, then the goals it does
// not measure.
func (r *results) summary() []row {
	var rows []row
	for _, g := range r.rowsOf() {
		s := r.byN(g.of)
		if s == nil || len(s.totals) == 0 {
			continue
		}
		if g.pair {
			if x, ok := r.pairRow(g, s); ok {
				rows = append(rows, x)
			}
			continue
		}
		x := row{Operation: g.label, N: len(s.totals), P50ms: msf(median(s.totals)), P99ms: msf(p99(s.totals)), Verdict: "–"}
		if to := r.byN(g.to); to != nil && median(to.totals) > 0 {
			x.Ratio, x.RatioTo = x.P50ms/msf(median(to.totals)), g.toLabel
		}
		if g.maxRatio > 0 {
			x.Goal = fmt.Sprintf("≤ %.1f× %s", g.maxRatio, g.toLabel)
			switch {
			case x.Ratio == 0:
				x.Verdict = "not measured (" + g.toLabel + " not run)"
			case x.Ratio <= g.maxRatio:
				x.Verdict = "met"
			default:
				x.Verdict = "not met" + r.rpcBound(s, r.byN(g.to))
			}
		}
		rows = append(rows, x)
	}
	rows = append(rows, r.dataPathRows()...)
	rows = append(rows, r.nriRows()...)
	if r.scale != nil {
		return append(rows, r.scale.rows()...)
	}
	for _, x := range scaleGoals {
		x.Verdict = "not measured (measurement 8: hack/bench.sh -phases 8)"
		rows = append(rows, x)
	}
	return rows
}

// pairRow compares two socket cycles that took turns: the difference of
// their p50 and p99, and the ratio of their p50 (held to the goal, if
// any; the p99 ratio is said beside it).
func (r *results) pairRow(g goal, s *sample) (row, bool) {
	to := r.byN(g.to)
	if to == nil || len(to.totals) == 0 || median(to.totals) <= 0 {
		return row{}, false
	}
	a50, b50, a99, b99 := median(s.totals), median(to.totals), p99(s.totals), p99(to.totals)
	x := row{Operation: g.label, Value: fmt.Sprintf("%+.2f ms (p50), %+.2f ms (p99)", msf(a50-b50), msf(a99-b99)),
		Ratio: float64(a50) / float64(b50), RatioTo: g.toLabel, Verdict: "–"}
	p99r := fmt.Sprintf("p99 %.2f×", float64(a99)/float64(b99))
	if g.maxRatio > 0 {
		x.Goal = fmt.Sprintf("≤ %.1f× %s", g.maxRatio, g.toLabel)
		x.Verdict = "not met"
		if x.Ratio <= g.maxRatio {
			x.Verdict = "met"
		}
		x.Verdict += "; " + p99r
		if al := r.byN(g.alone); x.Ratio > g.maxRatio && g.alone != 0 && al != nil && len(al.totals) > 0 {
			m := median(al.totals)
			x.Verdict += fmt.Sprintf("; the same plugin with its mounter in process: %.2f× %s, the hop to the mounter the other %+.2f ms",
				float64(m)/float64(b50), g.toLabel, msf(a50-m))
		}
	} else {
		x.Verdict = "– (" + p99r + ")"
	}
	return x, true
}

// rpcBound says, for a socket cycle that missed its goal, how far the
// floor plus the cycle's calls as no-op RPCs (and its calls to the
// mounter, when counted, as calls that do nothing) already are from the
// floor: what is left of the goal for the plugin's own work is the
// difference.
func (r *results) rpcBound(s, floor *sample) string {
	rpc, n := refMedian(r.noopRPC), rpcSteps(s)
	if rpc == 0 || n == 0 || floor == nil {
		return ""
	}
	f := median(floor.totals)
	extra, calls := time.Duration(n)*rpc, ""
	if mc, mr := mounterCallCount(s), refMedian(r.mounterRPC); mc > 0 && mr > 0 {
		extra += time.Duration(mc) * mr
		calls = fmt.Sprintf(" and %d mounter calls (%s each)", mc, ms(mr))
	}
	return fmt.Sprintf("; the floor plus %d no-op RPCs (%s each)%s alone: %.2f×", n, ms(rpc), calls, float64(f+extra)/float64(f))
}

// printSummary prints the summary as one markdown table.
func printSummary(w io.Writer, rows []row) {
	fmt.Fprintln(w, "| operation | p50 | p99 | ratio (p50) | goal | met |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---|---|")
	for _, x := range rows {
		p50, p99, ratio := "–", "–", "–"
		if x.N > 0 {
			p50, p99 = fmt.Sprintf("%.2f ms", x.P50ms), fmt.Sprintf("%.2f ms", x.P99ms)
		}
		if x.Value != "" {
			p50 = x.Value
		}
		if x.Ratio > 0 {
			ratio = fmt.Sprintf("%.2f× %s", x.Ratio, x.RatioTo)
		}
		goal := x.Goal
		if goal == "" {
			goal = "–"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", x.Operation, p50, p99, ratio, goal, x.Verdict)
	}
}

// report is what save writes as JSON.
type report struct {
	Time    time.Time            `json:"time"`
	Env     string               `json:"env"`
	Shape   string               `json:"shape"`             // the main instance
	Before  string               `json:"compare,omitempty"` // the -compare instance
	N       int                  `json:"n"`
	Warmup  int                  `json:"warmup"`
	Summary []row                `json:"summary"`
	Cycles  map[string][]float64 `json:"cycles_ms"` // every timed iteration, in the order run
	Data    []dataResult         `json:"data_path,omitempty"`
	Scale   *scaleResult         `json:"scale,omitempty"`
	// Steps are the median of every step of every cycle, by cycle.
	Steps map[string]map[string]float64 `json:"steps_p50_ms"`
}

// save writes the run's figures as JSON and its plot as SVG into dir, as
// bench-<UTC time>.json and .svg, and returns their paths.
func (r *results) save(dir string, now time.Time) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	rep := report{Time: now.UTC(), Env: r.env, Shape: r.shape, Before: r.before, N: r.o.n, Warmup: r.o.warmup, Summary: r.summary(),
		Cycles: map[string][]float64{}, Steps: map[string]map[string]float64{}, Data: r.dataPath, Scale: r.scale}
	for _, s := range r.samples {
		for _, d := range s.totals {
			rep.Cycles[s.name] = append(rep.Cycles[s.name], msf(d))
		}
		rep.Steps[s.name] = map[string]float64{}
		for step, ds := range s.steps {
			rep.Steps[s.name][step] = msf(median(ds))
		}
	}
	base := filepath.Join(dir, "bench-"+now.UTC().Format("20060102T150405Z"))
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(base+".json", append(js, '\n'), 0o644); err != nil {
		return nil, err
	}
	var svg strings.Builder
	r.plot(&svg)
	if err := os.WriteFile(base+".svg", []byte(svg.String()), 0o644); err != nil {
		return nil, err
	}
	files := []string{base + ".json", base + ".svg"}
	if r.scale != nil {
		svg.Reset()
		r.scale.plot(&svg)
		if err := os.WriteFile(base+"-scale.svg", []byte(svg.String()), 0o644); err != nil {
			return nil, err
		}
		files = append(files, base+"-scale.svg")
	}
	return files, nil
}

// plotted are the samples drawn, each socket cycle with its floor.
var plotted = []struct {
	n     int
	color string
	label string
}{
	{1, "#d62728", "publish cycle via socket"},
	{nAlonePublish, "#9467bd", "the same, plugin alone"},
	{nBeforePublish, "#7f7f7f", "the same, before (-compare)"},
	{nLeanPublish, "#ff7f0e", "the same, lean CSI server"},
	{2, "#ff9896", "its floor (direct syscalls)"},
	{4, "#1f77b4", "prepare cycle via socket"},
	{nAlonePrepare, "#17becf", "the same, plugin alone"},
	{nLeanPrepare, "#bcbd22", "the same, lean CSI server"},
	{5, "#aec7e8", "its floor"},
	{7, "#2ca02c", "first stage of a fresh volume"},
	{8, "#98df8a", "later stage of the same volume"},
}

// plot draws every timed iteration's latency against its index, one line
// per measurement: the socket cycles beside the floors they alternated
// with, and first against later stages.
func (r *results) plot(w *strings.Builder) {
	const width, height, left, right, top, bottom = 900, 480, 60, 260, 30, 40
	var maxN int
	var maxMs float64
	for _, p := range plotted {
		if s := r.byN(p.n); s != nil {
			maxN = max(maxN, len(s.totals))
			for _, d := range s.totals {
				maxMs = max(maxMs, msf(d))
			}
		}
	}
	if maxN < 2 || maxMs <= 0 {
		maxN, maxMs = 2, 1
	}
	yMax := niceCeil(maxMs)
	x := func(i int) float64 { return left + float64(i)*float64(width-left-right)/float64(maxN-1) }
	y := func(v float64) float64 { return top + (1-v/yMax)*float64(height-top-bottom) }
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(w, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(w, `<text x="%d" y="18" font-size="14">mountplan bench: latency of every timed iteration (ms), in the order run</text>`+"\n", left)
	for i := 0; i <= 5; i++ {
		v := yMax * float64(i) / 5
		fmt.Fprintf(w, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end">%.3g</text>`+"\n",
			left, width-right, y(v), y(v), left-6, y(v)+4, v)
	}
	fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="middle">iteration</text>`+"\n", (left+width-right)/2, height-8)
	legend := top + 10
	for _, p := range plotted {
		s := r.byN(p.n)
		if s == nil || len(s.totals) == 0 {
			continue
		}
		var pts []string
		for i, d := range s.totals {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(i), y(msf(d))))
		}
		fmt.Fprintf(w, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", p.color, strings.Join(pts, " "))
		fmt.Fprintf(w, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s, p50 %.2f ms</text>`+"\n",
			width-right+10, width-right+30, legend, legend, p.color, width-right+36, legend+4, html.EscapeString(p.label), msf(median(s.totals)))
		legend += 20
	}
	w.WriteString("</svg>\n")
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// dataPathRows are the summary's data path lines: for each queue depth,
// the direct I/O loop configuration with the best worse-of-read-and-write
// ratio to the backing file (at depth 16 held to the 0.9 goal). Buffered
// loop devices are left out: they measure the host's page cache, not the
// disk, and cache every image twice.
func (r *results) dataPathRows() []row {
	var rows []row
	for _, depth := range []int{1, 16} {
		best, bestName := 0.0, ""
		for _, x := range r.dataPath {
			if x.Depth != depth || x.Op != "read" || !strings.HasPrefix(x.Target, "loop, direct I/O") {
				continue
			}
			w := r.dataRatio(x.Target, "write", depth)
			if m := min(x.Ratio, w); m > best {
				best, bestName = m, x.Target
			}
		}
		if bestName == "" {
			continue
		}
		x := row{Operation: fmt.Sprintf("data path, O_DIRECT 1 MiB, queue depth %d: best loop setting (%s), worse of read and write", depth, bestName),
			Ratio: best, RatioTo: "backing file", Verdict: "–"}
		if depth == 16 {
			x.Goal = "≥ 0.9× backing file"
			x.Verdict = "not met"
			if best >= 0.9 {
				x.Verdict = "met"
			}
		}
		rows = append(rows, x)
	}
	return rows
}

func (r *results) dataRatio(target, op string, depth int) float64 {
	for _, x := range r.dataPath {
		if x.Target == target && x.Op == op && x.Depth == depth {
			return x.Ratio
		}
	}
	return 0
}

// printDataPath prints measurement 7 as one table.
func (r *results) printDataPath(w io.Writer) {
	if len(r.dataPath) == 0 {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Data path: O_DIRECT 1 MiB at random offsets in a 512 MiB image (targets in turn, round after round)")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| target | read QD1 | write QD1 | read QD16 | write QD16 |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|")
	var targets []string
	for _, x := range r.dataPath {
		if !slices.Contains(targets, x.Target) {
			targets = append(targets, x.Target)
		}
	}
	for _, t := range targets {
		cells := []string{t}
		for _, depth := range []int{1, 16} {
			for _, op := range []string{"read", "write"} {
				for _, x := range r.dataPath {
					if x.Target == t && x.Op == op && x.Depth == depth {
						cells = append(cells, fmt.Sprintf("%.0f MiB/s (%.2f×)", x.MiBps, x.Ratio))
					}
				}
			}
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
}
