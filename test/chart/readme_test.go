package chart_test

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
)

// TestChartReadmeNamesEveryValue: the chart's README.md has a row for every
// top-level key of values.yaml and of the schema, and none for a key that
// is gone, so that it cannot fall behind a new value.
func TestChartReadmeNamesEveryValue(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir, "README.md"))
	if err != nil {
		t.Fatalf("the chart has no README.md: %v", err)
	}
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([A-Za-z]+)` \\|").FindAllStringSubmatch(string(b), -1) {
		rows[m[1]] = true
	}
	if len(rows) == 0 {
		t.Fatal("README.md has no table of values (rows starting | `key` |)")
	}
	values, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for k := range values {
		keys[k] = true
	}
	props, _ := readSchema(t)["properties"].(map[string]any)
	for k := range props {
		keys[k] = true
	}
	var missing, stale []string
	for k := range keys {
		if !rows[k] {
			missing = append(missing, k)
		}
	}
	for k := range rows {
		if !keys[k] {
			stale = append(stale, k)
		}
	}
	sort.Strings(missing)
	sort.Strings(stale)
	if len(missing) > 0 {
		t.Errorf("charts/mountplan/README.md lacks a row for %v", missing)
	}
	if len(stale) > 0 {
		t.Errorf("charts/mountplan/README.md has rows for %v, which neither values.yaml nor the schema knows", stale)
	}
}
