// Command testreport reads `go test -json` from stdin and prints what a
// plain `go test` prints (one line per package, the output of each failed
// test), then a count of passed, failed and skipped tests with the reason of
// each skip. It exits 1 when a test or a package failed, and, under CI=true,
// when any test skipped: in CI a missing prerequisite must fail, never skip
// (package internal/testenv). Skips that -short asked for (make test-unit)
// are counted, not listed, and never fail the run.
//
//	set -o pipefail; go test -json ./... | go run ./hack/testreport
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"

	"github.com/mountplan/mountplan/internal/testenv"
)

// event is one line of test2json's output.
type event struct {
	Action     string
	Package    string
	ImportPath string // build-output and build-fail events
	Test       string
	Output     string
}

type key struct{ pkg, test string }

type report struct {
	out                    io.Writer
	output                 map[key][]string // output of tests (and packages: test "") still running
	passed, failed         int
	skipped                []string // "pkg Test: reason"
	shortSkips             int      // skips that -short mode asked for
	failedPkgs, buildFails int
	failures               []string // "pkg Test" and the test's own messages, for the recap
}

func main() {
	r := &report{out: os.Stdout, output: map[key][]string{}}
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var e event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			// Not test2json (go vet or the linker writing to stdout): pass it on.
			fmt.Fprintln(r.out, sc.Text())
			continue
		}
		r.add(e)
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "testreport: reading stdin: %v\n", err)
		os.Exit(2)
	}
	os.Exit(r.summary(testenv.InCI()))
}

func (r *report) add(e event) {
	k := key{e.Package, e.Test}
	switch e.Action {
	case "build-output":
		fmt.Fprint(r.out, e.Output)
	case "build-fail":
		r.buildFails++
	case "output":
		r.output[k] = append(r.output[k], e.Output)
	case "pass", "fail", "skip":
		lines := r.output[k]
		delete(r.output, k)
		if e.Test == "" {
			r.packageDone(e, lines)
			return
		}
		switch e.Action {
		case "pass":
			r.passed++
		case "fail":
			r.failed++
			fmt.Fprint(r.out, strings.Join(lines, ""))
			r.failures = append(r.failures, recap(e.Package, e.Test, lines))
		case "skip":
			reason := skipReason(lines)
			if strings.Contains(reason, testenv.ShortSkip) {
				r.shortSkips++
				return
			}
			r.skipped = append(r.skipped, fmt.Sprintf("%s %s: %s", e.Package, e.Test, reason))
		}
	}
}

// packageDone prints the package's result line ("ok", "FAIL", "?") and,
// when it failed, what it printed outside any test (a panic, a timeout, a
// TestMain failure).
func (r *report) packageDone(e event, lines []string) {
	if e.Action == "fail" {
		r.failedPkgs++
	}
	for _, l := range lines {
		result := strings.HasPrefix(l, "ok  \t") || strings.HasPrefix(l, "FAIL\t") || strings.HasPrefix(l, "?   \t")
		if result || e.Action == "fail" && l != "PASS\n" && l != "FAIL\n" {
			fmt.Fprint(r.out, l)
		}
	}
}

// skipReason is the line the skip came with (what t.Skip printed), without
// go test's indentation and file:line prefix.
func skipReason(lines []string) string {
	for i := len(lines) - 1; i >= 0; i-- {
		l := strings.TrimSpace(lines[i])
		if l == "" || strings.HasPrefix(l, "=== ") || strings.HasPrefix(l, "--- SKIP") {
			continue
		}
		return l
	}
	return "(no reason given)"
}

// recapLines and recapWidth bound a failed test's recap: its first
// messages, each cut short.
const (
	recapLines = 12
	recapWidth = 300
)

// fileLine starts what t.Error, t.Fatal and t.Log print: "x_test.go:12: ".
var fileLine = regexp.MustCompile(`^\s+[\w.-]+\.go:\d+: `)

// recap is a failed test's name and the first lines its t.Error, t.Fatal
// and t.Log calls printed, without what they printed on the lines after
// (the logs a failing test dumps). The summary repeats it after the counts:
// a reader of a long run's last lines (a CI log cut short) sees why a test
// failed, not only the end of the last log it dumped.
func recap(pkg, test string, lines []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "failed: %s %s", pkg, test)
	n := 0
	for _, l := range lines {
		if !fileLine.MatchString(l) {
			continue
		}
		if n++; n > recapLines {
			b.WriteString("\n\t...")
			break
		}
		l = strings.TrimSpace(l)
		if len(l) > recapWidth {
			l = l[:recapWidth] + " ..."
		}
		b.WriteString("\n\t" + l)
	}
	return b.String()
}

// summary prints the counts and the skips and returns the exit code.
func (r *report) summary(ci bool) int {
	fmt.Fprintf(r.out, "\ntests: %d passed, %d failed, %d skipped", r.passed, r.failed, len(r.skipped))
	if r.shortSkips > 0 {
		fmt.Fprintf(r.out, ", %d left out by -short (they need root, a tool or a device)", r.shortSkips)
	}
	if r.failedPkgs > 0 || r.buildFails > 0 {
		fmt.Fprintf(r.out, "; %d packages failed (%d did not build)", r.failedPkgs, r.buildFails)
	}
	fmt.Fprintln(r.out)
	for _, s := range r.skipped {
		fmt.Fprintln(r.out, "skipped:", s)
	}
	for _, f := range r.failures {
		fmt.Fprintln(r.out, f)
	}
	switch {
	case r.failed > 0 || r.failedPkgs > 0 || r.buildFails > 0:
		return 1
	case ci && len(r.skipped) > 0:
		fmt.Fprintf(r.out, "CI=true: %d tests skipped; under CI a missing prerequisite must fail the test, not skip it\n", len(r.skipped))
		return 1
	}
	return 0
}
