package metrics

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"
)

// dashboardPath is the Grafana dashboard shipped in deploy/.
var dashboardPath = filepath.Join(repoRoot, "deploy", "grafana", "mountplan-dashboard.json")

// targetLabels are the labels Prometheus adds to every series it scrapes:
// the dashboard may select and group by them whatever the metric.
var targetLabels = []string{"instance", "job"}

// gathered is a scrape of the registry the plugin creates (New), after
// one call of every recording method, so that every labelled metric has
// a series.
func gathered(t *testing.T) []*dto.MetricFamily {
	t.Helper()
	m := New(func() map[string]int { return map[string]int{"loop": 1} })
	m.ObserveRPC("/x", codes.OK, time.Millisecond)
	m.ObserveStep("attach", nil, time.Millisecond)
	m.NodeInfo("node-a")
	m.DaemonRestarted("p")
	m.Reconciled(nil)
	m.AddDaemonUsage(func(context.Context) ([]DaemonUsage, error) {
		return []DaemonUsage{{Volume: "v", Profile: "p", InCgroup: true, HasMemory: true}}, nil
	})
	m.WatchReboot(true, func() int { return 2 })
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// seriesLabels maps every series name a scrape of mfs shows (a
// histogram's _bucket, _sum and _count, a summary's own name, _sum and
// _count) to its label names.
func seriesLabels(mfs []*dto.MetricFamily) map[string][]string {
	out := map[string][]string{}
	for _, mf := range mfs {
		var labels []string
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if !slices.Contains(labels, lp.GetName()) {
					labels = append(labels, lp.GetName())
				}
			}
		}
		name := mf.GetName()
		switch mf.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			out[name+"_bucket"] = append(slices.Clone(labels), "le")
			out[name+"_sum"], out[name+"_count"] = labels, labels
		case dto.MetricType_SUMMARY:
			out[name] = append(slices.Clone(labels), "quantile")
			out[name+"_sum"], out[name+"_count"] = labels, labels
		default:
			out[name] = labels
		}
	}
	return out
}

// TestDashboardUsesExportedMetrics: every metric the Grafana dashboard's
// queries name is one the plugin's registry exports, every label a query
// selects, groups by or shows in a legend is a label of the metrics it
// queries, and every mountplan_ metric is on the dashboard.
func TestDashboardUsesExportedMetrics(t *testing.T) {
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var dash any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	known := seriesLabels(gathered(t))
	queries := dashboardQueries(dash)
	if len(queries) < 10 {
		t.Fatalf("only %d queries found in the dashboard: the walk is broken", len(queries))
	}
	used := map[string]bool{}
	for _, q := range queries {
		names, err := checkQuery(q, known)
		if err != nil {
			t.Errorf("%s: %v", q.where, err)
		}
		for _, n := range names {
			used[n] = true
		}
	}
	for _, mf := range gathered(t) {
		n := mf.GetName()
		if !strings.HasPrefix(n, namespace+"_") {
			continue
		}
		if !used[n] && !used[n+"_count"] && !used[n+"_bucket"] && !used[n+"_sum"] {
			t.Errorf("metric %s is on no panel of the dashboard", n)
		}
	}
}

// TestCheckQueryCatchesMistakes: the checker itself fails an unknown
// metric, a label the metric lacks (in a matcher, a by clause, a legend)
// and a selector without a name.
func TestCheckQueryCatchesMistakes(t *testing.T) {
	known := map[string][]string{
		"a_bucket": {"method", "le"}, "a_count": {"method"}, "g": {"type"},
	}
	for _, q := range []query{
		{expr: `sum(rate(a_total[5m]))`},
		{expr: `sum by (step) (rate(a_count[5m]))`},
		{expr: `g{method="x"}`},
		{expr: `sum(g) by (le)`},
		{expr: `{__name__="g"}`},
		{expr: `g`, legend: "{{method}}"},
		{expr: `frobnicate(g)`},
		{expr: `g{type="x"`},
	} {
		if _, err := checkQuery(q, known); err == nil {
			t.Errorf("%s (legend %q) passed", q.expr, q.legend)
		}
	}
	for _, q := range []query{
		{expr: `histogram_quantile(0.9, sum by (le, method) (rate(a_bucket{method!="x", job=~"$job"}[$__rate_interval])))`, legend: "{{method}}"},
		{expr: `sum without (type) (g) / on (instance) group_left count(g offset 1h)`},
		{expr: `g{type="a,b}"} > bool 0`, legend: "{{type}} {{instance}}"},
	} {
		if _, err := checkQuery(q, known); err != nil {
			t.Errorf("%s: %v", q.expr, err)
		}
	}
}

// query is one PromQL expression of the dashboard, with the legend that
// shows its labels.
type query struct {
	where, expr, legend string
}

// dashboardQueries finds every PromQL expression in a dashboard: each
// object's "expr" (panel targets, at any depth) with its "legendFormat",
// and each templating variable's label_values(...) query.
func dashboardQueries(dash any) []query {
	var out []query
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if e, ok := v["expr"].(string); ok {
				l, _ := v["legendFormat"].(string)
				out = append(out, query{where: path, expr: e, legend: l})
			}
			if v["type"] == "query" {
				if q, ok := v["query"].(map[string]any); ok {
					if s, ok := q["query"].(string); ok {
						out = append(out, labelValuesQuery(path+".query", s))
					}
				}
			}
			for k, x := range v {
				walk(path+"."+k, x)
			}
		case []any:
			for i, x := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), x)
			}
		}
	}
	walk("$", dash)
	return out
}

// labelValuesQuery turns Grafana's label_values(expr, label) into a query
// that groups expr by label, which checkQuery then checks.
func labelValuesQuery(where, s string) query {
	inner, ok := strings.CutPrefix(s, "label_values(")
	inner, ok2 := strings.CutSuffix(inner, ")")
	i := strings.LastIndex(inner, ",")
	if !ok || !ok2 || i < 0 {
		return query{where: where, expr: "unparsed_template_query(" + s + ")"}
	}
	return query{where: where, expr: "count by (" + strings.TrimSpace(inner[i+1:]) + ") (" + inner[:i] + ")"}
}

// promqlFuncs are the functions and aggregations the dashboard may call:
// a name outside it is a typo or needs adding here.
var promqlFuncs = []string{"sum", "avg", "min", "max", "count", "topk", "bottomk", "rate", "irate", "increase",
	"delta", "deriv", "histogram_quantile", "clamp_min", "clamp_max", "abs", "max_over_time", "min_over_time",
	"avg_over_time", "changes", "resets", "time", "vector", "scalar", "absent", "label_replace"}

// promqlKeywords are PromQL's words that are neither metrics nor functions.
var promqlKeywords = []string{"and", "or", "unless", "bool", "offset"}

// groupingWords take a parenthesised list of label names.
var groupingWords = []string{"by", "without", "on", "ignoring", "group_left", "group_right"}

var legendLabel = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)

// checkQuery checks q's metrics and labels against known (series name to
// label names) and returns the metric names it uses.
func checkQuery(q query, known map[string][]string) ([]string, error) {
	toks, err := lexPromQL(q.expr)
	if err != nil {
		return nil, err
	}
	var names, grouping []string
	var errs []error
	for i := 0; i < len(toks); i++ {
		t := toks[i]
		switch {
		case t.kind == '{':
			return nil, fmt.Errorf("%q: a selector without a metric name", q.expr)
		case t.kind != 'i':
			continue
		case slices.Contains(groupingWords, t.text):
			var labels []string
			if labels, i, err = labelList(toks, i+1); err != nil {
				return nil, fmt.Errorf("%q: %s: %w", q.expr, t.text, err)
			}
			grouping = append(grouping, labels...)
		case slices.Contains(promqlKeywords, t.text):
		case i+1 < len(toks) && (toks[i+1].kind == '(' || toks[i+1].text == "by" || toks[i+1].text == "without"):
			// a call, or an aggregation with its grouping first
			if !slices.Contains(promqlFuncs, t.text) {
				errs = append(errs, fmt.Errorf("%q: %s is not a function this check knows", q.expr, t.text))
			}
		default:
			labels, ok := known[t.text]
			if !ok {
				errs = append(errs, fmt.Errorf("%q: metric %s is not exported by the plugin", q.expr, t.text))
			}
			names = append(names, t.text)
			var matched []string
			if matched, i, err = matchers(toks, i+1); err != nil {
				return nil, fmt.Errorf("%q: %s: %w", q.expr, t.text, err)
			}
			for _, l := range matched {
				if ok && !hasLabel(labels, l) {
					errs = append(errs, fmt.Errorf("%q: %s has no label %s (it has %v)", q.expr, t.text, l, labels))
				}
			}
		}
	}
	for _, m := range legendLabel.FindAllStringSubmatch(q.legend, -1) {
		grouping = append(grouping, m[1])
	}
	for _, l := range grouping {
		for _, n := range names {
			if labels, ok := known[n]; ok && !hasLabel(labels, l) {
				errs = append(errs, fmt.Errorf("%q: groups or shows by %s, which %s lacks (it has %v)", q.expr, l, n, labels))
			}
		}
	}
	if len(names) == 0 {
		errs = append(errs, fmt.Errorf("%q names no metric", q.expr))
	}
	return names, errors.Join(errs...)
}

func hasLabel(labels []string, l string) bool {
	return slices.Contains(labels, l) || slices.Contains(targetLabels, l)
}

// labelList reads "( name, ... )" from toks[i:] and returns the names and
// the index of the closing parenthesis.
func labelList(toks []ptok, i int) ([]string, int, error) {
	if i >= len(toks) || toks[i].kind != '(' {
		if i < len(toks) && toks[i].kind == 'i' && toks[i-1].text != "by" && toks[i-1].text != "without" {
			return nil, i - 1, nil // group_left without a label list
		}
		return nil, 0, errors.New("no label list")
	}
	var out []string
	for i++; i < len(toks); i++ {
		switch toks[i].kind {
		case ')':
			return out, i, nil
		case 'i':
			out = append(out, toks[i].text)
		case ',':
		default:
			return nil, 0, fmt.Errorf("%q in a label list", toks[i].text)
		}
	}
	return nil, 0, errors.New("unclosed label list")
}

// matchers reads an optional "{ label op "value", ... }" from toks[i:] and
// returns the labels and the index of its last token (i-1 without one).
func matchers(toks []ptok, i int) ([]string, int, error) {
	if i >= len(toks) || toks[i].kind != '{' {
		return nil, i - 1, nil
	}
	var out []string
	for i++; i < len(toks); i++ {
		switch {
		case toks[i].kind == '}':
			return out, i, nil
		case toks[i].kind == ',':
		case toks[i].kind == 'i' && i+2 < len(toks) && toks[i+1].kind == 'o' && toks[i+2].kind == 's':
			out = append(out, toks[i].text)
			i += 2
		default:
			return nil, 0, fmt.Errorf("malformed matcher at %q", toks[i].text)
		}
	}
	return nil, 0, errors.New("unclosed selector")
}

// ptok is a PromQL token: kind 'i' an identifier, 's' a string, 'n' a
// number, 'r' a range or subquery ("[...]"), 'o' a matcher operator, '$'
// a Grafana variable, else the punctuation character itself.
type ptok struct {
	kind byte
	text string
}

// lexPromQL splits a PromQL expression (with Grafana's variables) into
// tokens: enough to tell metric names, label names and functions apart.
func lexPromQL(s string) ([]ptok, error) {
	var out []ptok
	isIdent := func(c byte, first bool) bool {
		return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
	}
	for i := 0; i < len(s); {
		c := s[i]
		j := i + 1
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			i++
			continue
		case c == '"' || c == '\'' || c == '`':
			for j < len(s) && s[j] != c {
				if s[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(s) {
				return nil, fmt.Errorf("%q: unterminated string", s)
			}
			out = append(out, ptok{'s', s[i+1 : j]})
			i = j + 1
			continue
		case c == '[':
			k := strings.IndexByte(s[i:], ']')
			if k < 0 {
				return nil, fmt.Errorf("%q: unclosed range", s)
			}
			j = i + k + 1
			out = append(out, ptok{'r', s[i:j]})
		case c == '$':
			for j < len(s) && (isIdent(s[j], false) || s[j] == '{' || s[j] == '}') {
				j++
			}
			out = append(out, ptok{'$', s[i:j]})
		case isIdent(c, true):
			for j < len(s) && isIdent(s[j], false) {
				j++
			}
			out = append(out, ptok{'i', s[i:j]})
		case c >= '0' && c <= '9' || c == '.':
			for j < len(s) && (s[j] == '.' || isIdent(s[j], false)) {
				j++
			}
			out = append(out, ptok{'n', s[i:j]})
		case strings.HasPrefix(s[i:], "=~") || strings.HasPrefix(s[i:], "!~") || strings.HasPrefix(s[i:], "!="):
			j = i + 2
			out = append(out, ptok{'o', s[i:j]})
		case strings.HasPrefix(s[i:], "==") || strings.HasPrefix(s[i:], ">=") || strings.HasPrefix(s[i:], "<="):
			j = i + 2
			out = append(out, ptok{'c', s[i:j]})
		case c == '=':
			out = append(out, ptok{'o', "="})
		default:
			out = append(out, ptok{c, string(c)})
		}
		i = j
	}
	return out, nil
}

// TestDashboardNodeVariable: the dashboard's "Node" variable lists node
// names (mountplan_node_info's node label, what the plugin's --node-id
// says), not scrape addresses; the instance every panel selects on is
// derived from the nodes picked, and is hidden.
func TestDashboardNodeVariable(t *testing.T) {
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Templating struct {
			List []struct {
				Name, Label string
				Hide        int
				Query       any
			}
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	queries := map[string]string{}
	hidden := map[string]bool{}
	for _, v := range dash.Templating.List {
		q, _ := v.Query.(map[string]any)
		s, _ := q["query"].(string)
		queries[v.Name], hidden[v.Name] = s, v.Hide == 2
		if v.Label == "Node" && v.Name != "node" {
			t.Errorf("the variable labelled Node is %s, want node", v.Name)
		}
	}
	if want := `label_values(mountplan_node_info{job=~"$job"}, node)`; queries["node"] != want {
		t.Errorf("variable node queries %q, want %q", queries["node"], want)
	}
	if want := `label_values(mountplan_node_info{job=~"$job", node=~"$node"}, instance)`; queries["instance"] != want {
		t.Errorf("variable instance queries %q, want %q", queries["instance"], want)
	}
	if !hidden["instance"] {
		t.Error("variable instance is shown: the nodes are picked by name")
	}
}

// TestDashboardShowsStepFailures: a panel shows the device steps that
// failed, by step.
func TestDashboardShowsStepFailures(t *testing.T) {
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var dash any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	for _, q := range dashboardQueries(dash) {
		if strings.Contains(q.expr, "mountplan_step_duration_seconds_count") && strings.Contains(q.expr, `result="error"`) &&
			strings.Contains(q.expr, "by (step)") {
			return
		}
	}
	t.Error(`no query of the dashboard shows mountplan_step_duration_seconds_count{result="error"} by step`)
}
