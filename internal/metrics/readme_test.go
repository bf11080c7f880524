package metrics

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// repoRoot is the module's root, seen from this package.
var repoRoot = filepath.Join("..", "..")

// readmeMetrics returns README's metrics section: from its "Metrics (" line
// to the next heading.
func readmeMetrics(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\nMetrics (")
	if !ok {
		t.Fatal(`README.md has no metrics section (a paragraph starting "Metrics (")`)
	}
	sec, _, _ = strings.Cut(sec, "\n#")
	return sec
}

// stepLabels finds every step label the code emits: the string literal
// given to a Step or ObserveStep call anywhere outside tests.
func stepLabels(t *testing.T) map[string]string {
	t.Helper()
	labels := map[string]string{}
	err := filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && p != repoRoot {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "Step" && sel.Sel.Name != "ObserveStep") {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				if !strings.HasSuffix(filepath.ToSlash(p), "internal/metrics/metrics.go") {
					t.Errorf("%s: a step label that is not a string literal: README cannot be checked against it", fset.Position(call.Pos()))
				}
				return true
			}
			label, err := strconv.Unquote(lit.Value)
			if err != nil {
				t.Fatal(err)
			}
			labels[label] = fset.Position(call.Pos()).String()
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return labels
}

// TestReadmeListsEveryStep: README's metrics section names every step label
// the code emits.
func TestReadmeListsEveryStep(t *testing.T) {
	sec := readmeMetrics(t)
	labels := stepLabels(t)
	// The calls this test must find, or it finds nothing at all.
	for _, want := range []string{"attach", "format", "mount", "daemon_start", "nbd_connect", "iscsi_login"} {
		if _, ok := labels[want]; !ok {
			t.Errorf("no Step(%q) call found: the search is broken", want)
		}
	}
	for label, where := range labels {
		if !strings.Contains(sec, "`"+label+"`") {
			t.Errorf("step %q (%s) is not in README's metrics section", label, where)
		}
	}
}

// TestReadmeListsEveryMetric: README's metrics section names every metric
// of mountplan's own that a scrape shows.
func TestReadmeListsEveryMetric(t *testing.T) {
	sec := readmeMetrics(t)
	var names []string
	for _, mf := range gathered(t) {
		if strings.HasPrefix(mf.GetName(), namespace+"_") {
			names = append(names, mf.GetName())
		}
	}
	if len(names) < 5 {
		t.Fatalf("the scrape shows only %v", names)
	}
	for _, n := range names {
		if !strings.Contains(sec, "`"+n+"`") {
			t.Errorf("metric %s is not in README's metrics section", n)
		}
	}
	if !slices.Contains(names, namespace+"_staged_volumes") {
		t.Errorf("the scrape lacks %s_staged_volumes: %v", namespace, names)
	}
}
