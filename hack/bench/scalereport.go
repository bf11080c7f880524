package main

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// Goals of issue 13 for measurement 8.
const (
	scaleGoalN        = 10000 // the per-volume and restart goals hold at this many volumes
	scaleMaxRatio     = 1.2   // an operation's p50 at scaleGoalN against the lowest level
	teardownGoalS     = 10.0
	restartReadyGoalS = 1.0
	restartRSSGoalMiB = 50.0
	idleCPUGoalPct    = 1.0
)

func (sr *scaleResult) lo() int  { return sr.Levels[0] }
func (sr *scaleResult) top() int { return sr.Levels[len(sr.Levels)-1] }

// verdict says met or not met, or why the goal does not apply at n volumes.
func verdict(ok bool, n int) string {
	switch {
	case n < scaleGoalN:
		return fmt.Sprintf("not measured at %s (-scale stops at %s)", thousands(scaleGoalN), thousands(n))
	case ok:
		return "met"
	}
	return "not met"
}

func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// opNames are the per-volume operations in their order, then the floor's.
func (sr *scaleResult) opNames() []string {
	names := slices.Clone(scaleOps)
	for _, op := range sr.order {
		if !slices.Contains(names, op) {
			names = append(names, op)
		}
	}
	return names
}

// kernelPart names, for the operations whose kernel work grows with the
// node's devices and mounts, the floor step that does that work alone.
var kernelPart = map[string]string{
	"NodeStageVolume":   "floor step: attach",
	"NodePublishVolume": "floor step: mount(2)",
}

// floorOf is the floor step of op measured in this run, or "".
func (sr *scaleResult) floorOf(op string) string {
	prefix, ok := kernelPart[op]
	if !ok {
		return ""
	}
	for _, name := range sr.order {
		if strings.HasPrefix(name, prefix) {
			return name
		}
	}
	return ""
}

// ownRatio is the growth of op's time less its floor step's (p50 minus
// p50 at the top level against the same at the lowest): the plugin's own
// part of op.
func (sr *scaleResult) ownRatio(op string) (float64, bool) {
	f := sr.floorOf(op)
	if f == "" {
		return 0, false
	}
	own := func(n int) time.Duration { return median(sr.ops[op][n]) - median(sr.ops[f][n]) }
	hi, lo := own(sr.top()), own(sr.lo())
	if lo <= 0 || hi <= 0 || len(sr.ops[op][sr.top()]) == 0 || len(sr.ops[f][sr.top()]) == 0 {
		return 0, false
	}
	return float64(hi) / float64(lo), true
}

// rows are the summary's lines of measurement 8.
func (sr *scaleResult) rows() []row {
	var rows []row
	lo, top := sr.lo(), sr.top()
	for _, op := range sr.opNames() {
		hi, base := sr.ops[op][top], sr.ops[op][lo]
		if len(hi) == 0 {
			continue
		}
		x := row{Operation: fmt.Sprintf("%s at %s staged and published volumes", op, thousands(top)),
			N: len(hi), P50ms: msf(median(hi)), P99ms: msf(p99(hi)), Verdict: "–"}
		if len(base) > 0 && median(base) > 0 && top != lo {
			x.Ratio, x.RatioTo = x.P50ms/msf(median(base)), "at "+thousands(lo)
		}
		if slices.Contains(scaleOps, op) {
			x.Goal = fmt.Sprintf("≤ %.1f× at %s", scaleMaxRatio, thousands(lo))
			x.Verdict = verdict(x.Ratio > 0 && x.Ratio <= scaleMaxRatio, top)
			if own, ok := sr.ownRatio(op); ok && x.Verdict == "not met" {
				x.Verdict = fmt.Sprintf("not met; less its kernel floor (%s): %.2f×", sr.floorOf(op), own)
			}
		}
		rows = append(rows, x)
	}
	for _, d := range sr.Down {
		n := d.From - d.To
		x := row{Operation: fmt.Sprintf("teardown of %s volumes (unpublish, unstage, delete), %d clients, %s → %s held",
			thousands(n), sr.Clients, thousands(d.From), thousands(d.To)), Value: fmt.Sprintf("%.2f s", d.Seconds), Verdict: "–"}
		if n == teardownBatch {
			x.Goal = fmt.Sprintf("≤ %.0f s", teardownGoalS)
			x.Verdict = "not met"
			if d.Seconds <= teardownGoalS {
				x.Verdict = "met"
			}
		}
		rows = append(rows, x)
	}
	if rr := sr.Restart; rr != nil {
		n := thousands(rr.Volumes)
		rows = append(rows,
			row{Operation: fmt.Sprintf("restart with %s staged and published volumes: socket accepts", n),
				Value: fmt.Sprintf("%.0f ms", rr.ListeningMs), Verdict: "–"},
			row{Operation: fmt.Sprintf("restart with %s staged and published volumes: ready (Probe, startup reconcile done)", n),
				Value: fmt.Sprintf("%.0f ms", rr.ReadyMs), Goal: fmt.Sprintf("≤ %.0f s", restartReadyGoalS),
				Verdict: verdict(rr.ReadyMs <= 1000*restartReadyGoalS, rr.Volumes)},
			row{Operation: fmt.Sprintf("RSS of the restarted plugin with %s volumes (ready and after %.0f s idle)", n, rr.IdleSeconds),
				Value: fmt.Sprintf("%.1f MiB", rr.RSSMiB), Goal: fmt.Sprintf("≤ %.0f MiB", restartRSSGoalMiB),
				Verdict: verdict(rr.RSSMiB <= restartRSSGoalMiB, rr.Volumes)},
			row{Operation: fmt.Sprintf("idle plugin with %s volumes, reconcile every %s: CPU over %.0f s", n, rr.ReconcileInterval, rr.IdleSeconds),
				Value: fmt.Sprintf("%.2f %% of a core", rr.IdleCPUPercent), Goal: fmt.Sprintf("≤ %.0f %% of a core", idleCPUGoalPct),
				Verdict: verdict(rr.IdleCPUPercent <= idleCPUGoalPct, rr.Volumes)})
		if rr.MounterRSSMiB > 0 {
			rows = append(rows,
				row{Operation: fmt.Sprintf("RSS of the mounter (mountplan-sidecar serve, not restarted) holding %s volumes' loop devices (at the plugin's ready and after %.0f s idle)", n, rr.IdleSeconds),
					Value: fmt.Sprintf("%.1f MiB", rr.MounterRSSMiB), Verdict: fmt.Sprintf("– (plugin and mounter: %.1f MiB)", rr.RSSMiB+rr.MounterRSSMiB)},
				row{Operation: fmt.Sprintf("idle mounter with %s volumes: CPU over the same %.0f s", n, rr.IdleSeconds),
					Value: fmt.Sprintf("%.2f %% of a core", rr.MounterIdleCPUPercent), Verdict: fmt.Sprintf("– (plugin and mounter: %.2f %%)", rr.IdleCPUPercent+rr.MounterIdleCPUPercent)})
		}
	}
	return rows
}

// print writes measurement 8's details: every operation's p50 at every
// level, the fill times, the restart.
func (sr *scaleResult) print(w io.Writer) {
	if sr == nil {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "### Scale: p50 of %s MiB ext4 loop volumes' operations by the number staged and published (%d clients fill the node)\n\n", fmt.Sprint(sr.SizeMiB), sr.Clients)
	head, rule := "| operation |", "|---|"
	for _, n := range sr.Levels {
		head += " " + thousands(n) + " |"
		rule += "---:|"
	}
	fmt.Fprintln(w, head+" p50 at top / lowest |")
	fmt.Fprintln(w, rule+"---:|")
	for _, op := range sr.opNames() {
		if len(sr.ops[op]) == 0 {
			continue
		}
		cells := []string{op}
		for _, n := range sr.Levels {
			cells = append(cells, cell(sr.ops[op][n]))
		}
		r := "–"
		if a, b := median(sr.ops[op][sr.top()]), median(sr.ops[op][sr.lo()]); a > 0 && b > 0 {
			r = fmt.Sprintf("%.2f×", float64(a)/float64(b))
		}
		fmt.Fprintf(w, "| %s | %s |\n", strings.Join(cells, " | "), r)
		if own, ok := sr.ownRatio(op); ok {
			f := sr.floorOf(op)
			cells := []string{op + " less " + f}
			for _, n := range sr.Levels {
				cells = append(cells, ms(median(sr.ops[op][n])-median(sr.ops[f][n])))
			}
			fmt.Fprintf(w, "| %s | %.2f× |\n", strings.Join(cells, " | "), own)
		}
	}
	var fill []string
	for _, n := range sr.Levels {
		if s, ok := sr.FillS[fmt.Sprint(n)]; ok {
			fill = append(fill, fmt.Sprintf("to %s in %.2f s", thousands(n), s))
		}
	}
	if len(fill) > 0 {
		fmt.Fprintf(w, "\nFilling (create, stage, publish): %s.\n", strings.Join(fill, ", "))
	}
	if rr := sr.Restart; rr != nil {
		fmt.Fprintf(w, "Restart (%s) with %s volumes: socket accepts after %.0f ms, ready after %.0f ms; RSS %.1f MiB (peak %.1f MiB); idle %.0f s with --reconcile-interval %s: %.2f %% of a core.\n",
			rr.Shape, thousands(rr.Volumes), rr.ListeningMs, rr.ReadyMs, rr.RSSMiB, rr.HWMMiB, rr.IdleSeconds, rr.ReconcileInterval, rr.IdleCPUPercent)
		if rr.MounterRSSMiB > 0 {
			fmt.Fprintf(w, "The mounter beside it (not restarted): RSS %.1f MiB (peak %.1f MiB); idle over the same window: %.2f %% of a core.\n",
				rr.MounterRSSMiB, rr.MounterHWMMiB, rr.MounterIdleCPUPercent)
		}
	}
}

func cell(ds []time.Duration) string {
	if len(ds) == 0 {
		return "–"
	}
	return ms(median(ds))
}

// plot draws each operation's p50 against the number of volumes (log
// scale).
func (sr *scaleResult) plot(w *strings.Builder) {
	const width, height, left, right, top, bottom = 900, 480, 60, 330, 30, 40
	var maxMs float64
	for _, byN := range sr.ops {
		for _, ds := range byN {
			maxMs = max(maxMs, msf(median(ds)))
		}
	}
	if maxMs <= 0 {
		maxMs = 1
	}
	yMax := niceCeil(maxMs)
	lx0, lx1 := math.Log10(float64(sr.lo())), math.Log10(float64(max(sr.top(), sr.lo()+1)))
	x := func(n int) float64 {
		return left + (math.Log10(float64(n))-lx0)/(lx1-lx0)*float64(width-left-right)
	}
	y := func(v float64) float64 { return top + (1-v/yMax)*float64(height-top-bottom) }
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(w, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(w, `<text x="%d" y="18" font-size="14">mountplan bench: p50 latency (ms) against staged and published volumes</text>`+"\n", left)
	for i := 0; i <= 5; i++ {
		v := yMax * float64(i) / 5
		fmt.Fprintf(w, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end">%.3g</text>`+"\n",
			left, width-right, y(v), y(v), left-6, y(v)+4, v)
	}
	for _, n := range sr.Levels {
		fmt.Fprintf(w, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x(n), height-bottom+16, thousands(n))
	}
	fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="middle">volumes (log scale)</text>`+"\n", (left+width-right)/2, height-6)
	colors := []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"}
	legend := top + 10
	for i, op := range sr.opNames() {
		var pts []string
		for _, n := range sr.Levels {
			if ds := sr.ops[op][n]; len(ds) > 0 {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(n), y(msf(median(ds)))))
			}
		}
		if len(pts) == 0 {
			continue
		}
		c := colors[i%len(colors)]
		fmt.Fprintf(w, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", c, strings.Join(pts, " "))
		fmt.Fprintf(w, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s</text>`+"\n",
			width-right+10, width-right+30, legend, legend, c, width-right+36, legend+4, html.EscapeString(op))
		legend += 20
	}
	w.WriteString("</svg>\n")
}
