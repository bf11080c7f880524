package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// nriResult is what measurement 9 read from BenchmarkContainerStart
// (test/nri): container start latency through a private containerd 2 with
// and without the NRI hook, and the hook's own time per container from
// the sidecar's log.
type nriResult struct {
	// starts are the rows of its table: what the container's /data is,
	// median and p90 of crictl create + start, in ms.
	starts []nriStart
	// The hook's CreateContainer and StartContainer, median and p90 in ms.
	createP50, createP90, startP50, startP90 float64
	output                                   string // the benchmark's output, as printed
}

type nriStart struct {
	what     string
	p50, p90 float64
}

// nriBenchmark is how measurement 9 runs it, from the repository's root
// (hack/bench.sh runs the bench there).
var nriBenchmark = []string{"go", "test", "-count=1", "-run", "^$", "-bench", "^BenchmarkContainerStart$", "-benchtime", "1x", "./test/nri"}

// measureNRIHook runs BenchmarkContainerStart and reads its figures. It
// needs what the NRI tests need (hack/tools/build.sh containerd crictl,
// runc) and takes about as long as 60 container starts and the build of
// the test binary; the bench's own processes are idle meanwhile (the
// test's leak check compares the machine before and after it).
func (b *bench) measureNRIHook(ctx context.Context) (*nriResult, error) {
	b.logf("measurement 9: %s", strings.Join(nriBenchmark, " "))
	cmd := exec.CommandContext(ctx, nriBenchmark[0], nriBenchmark[1:]...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		os.Stderr.Write(out)
		return nil, fmt.Errorf("%s: %w", strings.Join(nriBenchmark, " "), err)
	}
	res, err := parseNRIBenchmark(strings.NewReader(string(out)))
	if err != nil {
		os.Stderr.Write(out)
		return nil, err
	}
	res.output = string(out)
	return res, nil
}

// parseNRIBenchmark reads the table and the hook's line that
// BenchmarkContainerStart prints:
//
//	| host directory, no volume | 77.1 | 91.7 | -4.6 ms |
//	in the hook (the sidecar's log): CreateContainer median 1.26 ms (p90 1.70), StartContainer median 1.12 ms (p90 1.53)
func parseNRIBenchmark(r io.Reader) (*nriResult, error) {
	res := &nriResult{}
	hook := false
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if rest, ok := strings.CutPrefix(line, "in the hook (the sidecar's log): "); ok {
			_, err := fmt.Sscanf(rest, "CreateContainer median %f ms (p90 %f), StartContainer median %f ms (p90 %f)",
				&res.createP50, &res.createP90, &res.startP50, &res.startP90)
			if err != nil {
				return nil, fmt.Errorf("BenchmarkContainerStart: the hook's line %q: %w", line, err)
			}
			hook = true
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if !strings.HasPrefix(line, "|") || len(cells) != 4 {
			continue
		}
		p50, err1 := strconv.ParseFloat(strings.TrimSpace(cells[1]), 64)
		p90, err2 := strconv.ParseFloat(strings.TrimSpace(cells[2]), 64)
		if err1 != nil || err2 != nil { // the header and its rule
			continue
		}
		res.starts = append(res.starts, nriStart{what: strings.TrimSpace(cells[0]), p50: p50, p90: p90})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !hook || len(res.starts) == 0 {
		return nil, fmt.Errorf("BenchmarkContainerStart printed no table or no hook line (has its output changed?)")
	}
	return res, nil
}

// nriRows are the summary's lines of measurement 9: the hook per container
// against its lean equivalent, a handler that makes one NodePrepareVolume
// call to the lean server at each of the two events (twice the median of
// that step in measurement 4's lean cycle, when it ran), then the
// container starts.
func (r *results) nriRows() []row {
	n := r.nri
	if n == nil {
		return nil
	}
	hook := row{Operation: "NRI hook per container: CreateContainer + StartContainer in the hook (the sidecar's log; BenchmarkContainerStart, median of 20)",
		Value:   fmt.Sprintf("%.2f + %.2f = %.2f ms (p90 %.2f, %.2f)", n.createP50, n.startP50, n.createP50+n.startP50, n.createP90, n.startP90),
		Verdict: "–"}
	if l := r.byN(nLeanPrepare); l != nil {
		if ds, ok := l.steps["NodePrepareVolume"]; ok && median(ds) > 0 {
			lean := 2 * msf(median(ds))
			hook.Ratio, hook.RatioTo = (n.createP50+n.startP50)/lean, fmt.Sprintf("lean (2 × its NodePrepareVolume, %.2f ms)", lean)
		}
	}
	rows := []row{hook}
	var base float64
	for _, s := range n.starts {
		if strings.HasPrefix(s.what, "host directory") {
			base = s.p50
		}
	}
	for _, s := range n.starts {
		x := row{Operation: "container start (crictl create + start), /data: " + s.what, Value: fmt.Sprintf("%.1f ms (p90 %.1f ms)", s.p50, s.p90), Verdict: "–"}
		if base > 0 && !strings.HasPrefix(s.what, "host directory") {
			x.Ratio, x.RatioTo = s.p50/base, "host directory"
		}
		rows = append(rows, x)
	}
	return rows
}

// print shows the benchmark's own output.
func (n *nriResult) print(w io.Writer) {
	if n == nil {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "### NRI hook: %s\n\n", strings.Join(nriBenchmark, " "))
	fmt.Fprintln(w, strings.TrimSpace(n.output))
}
