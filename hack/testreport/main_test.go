package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func run(t *testing.T, ci bool, events ...event) (string, int) {
	t.Helper()
	var out bytes.Buffer
	r := &report{out: &out, output: map[key][]string{}}
	for _, e := range events {
		// Through JSON, as go test -json writes them.
		b, _ := json.Marshal(e)
		var back event
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		r.add(back)
	}
	code := r.summary(ci)
	return out.String(), code
}

func out(pkg, test, line string) event {
	return event{Action: "output", Package: pkg, Test: test, Output: line}
}

func TestReport(t *testing.T) {
	passing := []event{
		out("p", "TestA", "=== RUN   TestA\n"), out("p", "TestA", "    a_test.go:3: fine\n"), {Action: "pass", Package: "p", Test: "TestA"},
		out("p", "", "ok  \tp\t0.1s\n"), {Action: "pass", Package: "p"},
	}
	skip := []event{
		out("q", "TestB", "=== RUN   TestB\n"), out("q", "TestB", "    b_test.go:9: skipping: missing prerequisite: /dev/fuse\n"),
		out("q", "TestB", "--- SKIP: TestB (0.00s)\n"), {Action: "skip", Package: "q", Test: "TestB"},
		out("q", "", "ok  \tq\t0.1s\n"), {Action: "pass", Package: "q"},
	}
	shortSkip := []event{
		out("q", "TestC", "    c_test.go:1: skipping in -short mode (make test-unit): needs root\n"), {Action: "skip", Package: "q", Test: "TestC"},
	}
	failing := []event{
		out("r", "TestD", "    d_test.go:5: the volume was reformatted\n"), out("r", "TestD", "    env_test.go:9: containerd log, last lines:\n"),
		out("r", "TestD", "        time=x level=info msg=\"Stop CRI service\"\n"), out("r", "TestD", "--- FAIL: TestD (0.00s)\n"), {Action: "fail", Package: "r", Test: "TestD"},
		out("r", "", "FAIL\n"), out("r", "", "FAIL\tr\t0.2s\n"), {Action: "fail", Package: "r"},
	}
	for _, c := range []struct {
		name    string
		ci      bool
		events  [][]event
		code    int
		says    []string
		saysNot []string
	}{
		{"pass", true, [][]event{passing}, 0, []string{"ok  \tp\t0.1s", "tests: 1 passed, 0 failed, 0 skipped"}, []string{"fine"}},
		{"skip outside CI", false, [][]event{passing, skip}, 0, []string{"1 skipped", "skipped: q TestB: b_test.go:9: skipping: missing prerequisite: /dev/fuse"}, nil},
		{"skip in CI", true, [][]event{passing, skip}, 1, []string{"CI=true: 1 tests skipped"}, nil},
		{"short skip in CI", true, [][]event{passing, shortSkip}, 0, []string{"0 skipped, 1 left out by -short"}, []string{"skipped: q TestC"}},
		{"fail", false, [][]event{passing, failing}, 1, []string{"the volume was reformatted", "FAIL\tr\t0.2s", "1 failed", "1 packages failed",
			// After the counts: the test's messages again, not the logs it dumped.
			"1 packages failed (0 did not build)\nfailed: r TestD\n\td_test.go:5: the volume was reformatted\n\tenv_test.go:9: containerd log, last lines:\n"}, nil},
		{"build fail", false, [][]event{{{Action: "build-output", ImportPath: "s", Output: "s/x.go:1: syntax error\n"}, {Action: "build-fail", ImportPath: "s"}}}, 1, []string{"syntax error", "1 did not build"}, nil},
	} {
		var all []event
		for _, es := range c.events {
			all = append(all, es...)
		}
		got, code := run(t, c.ci, all...)
		if code != c.code {
			t.Errorf("%s: exit %d, want %d; output:\n%s", c.name, code, c.code, got)
		}
		for _, s := range c.says {
			if !strings.Contains(got, s) {
				t.Errorf("%s: output lacks %q:\n%s", c.name, s, got)
			}
		}
		for _, s := range c.saysNot {
			if strings.Contains(got, s) {
				t.Errorf("%s: output has %q:\n%s", c.name, s, got)
			}
		}
	}
}
