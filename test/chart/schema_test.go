package chart_test

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/test/chart/chartrender"
)

var schemaFile = filepath.Join(chartDir, "values.schema.json")

// readSchema reads values.schema.json as a generic JSON document.
func readSchema(t *testing.T) map[string]any {
	t.Helper()
	b, err := os.ReadFile(schemaFile)
	if err != nil {
		t.Fatalf("the chart has no values.schema.json: %v", err)
	}
	var s map[string]any
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	return s
}

// clusterValues returns the values test/cluster installs the chart with: the
// format string of test/cluster/env.go's values(), each verb replaced with a
// made-up absolute path (%s) or a number (%d).
func clusterValues(t *testing.T) map[string]any {
	t.Helper()
	src := filepath.Join("..", "cluster", "env.go")
	f, err := parser.ParseFile(token.NewFileSet(), src, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var format string
	ast.Inspect(f, func(n ast.Node) bool {
		fd, ok := n.(*ast.FuncDecl)
		if !ok || fd.Name.Name != "values" || fd.Recv == nil || format != "" {
			return format == ""
		}
		ast.Inspect(fd.Body, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 || format != "" {
				return format == ""
			}
			if sel, ok := call.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "Sprintf" {
				if lit, ok := call.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					format, _ = strconv.Unquote(lit.Value)
				}
			}
			return format == ""
		})
		return false
	})
	if format == "" {
		t.Fatalf("%s: no fmt.Sprintf format in func (e *env) values(): update clusterValues", src)
	}
	verb := regexp.MustCompile(`%\[(\d+)\]([sd])`)
	text := verb.ReplaceAllStringFunc(format, func(v string) string {
		m := verb.FindStringSubmatch(v)
		if m[2] == "d" {
			return m[1]
		}
		return "/tmp/cluster/v" + m[1]
	})
	var v map[string]any
	if err := yaml.Unmarshal([]byte(text), &v); err != nil {
		t.Fatalf("%s: values(): %v\n%s", src, err, text)
	}
	return v
}

// TestSchemaAcceptsDefaults: the chart carries a schema, its own values.yaml
// and every value set of the other tests pass it (render and lint), and so do
// the values test/cluster installs with.
func TestSchemaAcceptsDefaults(t *testing.T) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	if ch.Schema == nil {
		t.Fatal("the chart has no values.schema.json: helm validates nothing")
	}
	readSchema(t)
	for _, vs := range valueSets {
		t.Run(vs.name, func(t *testing.T) {
			if err := chartutil.ValidateAgainstSchema(ch, effectiveValues(t, vs.values)); err != nil {
				t.Errorf("the schema rejects the value set %s: %v", vs.name, err)
			}
		})
	}
	// FUSE profiles stay open: a field the plugin learns later needs no schema change.
	t.Run("FUSE profile field added later", func(t *testing.T) {
		over := map[string]any{"config": map[string]any{"fuseProfiles": []any{map[string]any{
			"name": "sshfs", "binary": "/usr/bin/sshfs", "args": []any{"{source}", "{mountpoint}"},
			"source":           map[string]any{"pattern": "[a-z]+@[a-z.]+:[a-z/]*", "aSourceFieldAddedLater": true},
			"aFieldAddedLater": map[string]any{"anything": []any{1, "two"}}}}}}
		if err := chartutil.ValidateAgainstSchema(ch, effectiveValues(t, over)); err != nil {
			t.Errorf("the schema rejects a FUSE profile with a field it does not know: %v", err)
		}
	})
	t.Run("test/cluster", func(t *testing.T) {
		over := clusterValues(t)
		if _, ok := over["kubeletDir"]; !ok {
			t.Fatalf("test/cluster's values lack kubeletDir: %v", over)
		}
		if err := chartutil.ValidateAgainstSchema(ch, effectiveValues(t, over)); err != nil {
			t.Fatalf("the schema rejects test/cluster's values: %v", err)
		}
		if _, err := chartrender.Render(chartDir, over); err != nil {
			t.Fatalf("render with test/cluster's values: %v", err)
		}
		kv, err := chartutil.ParseKubeVersion(chartrender.KubeVersion)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range lint.AllWithKubeVersion(chartDir, over, chartrender.Namespace, kv).Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("helm lint: %v", m)
			}
		}
	})
}

// TestSchemaRejects: each wrong value fails the render (helm install,
// upgrade, template) and helm lint, and the error names the value.
func TestSchemaRejects(t *testing.T) {
	kv, err := chartutil.ParseKubeVersion(chartrender.KubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	profile := func(extra map[string]any) map[string]any {
		p := map[string]any{"name": "x", "binary": "/bin/x", "args": []any{"{mountpoint}"}}
		for k, v := range extra {
			p[k] = v
		}
		return map[string]any{"config": map[string]any{"fuseProfiles": []any{p}}}
	}
	for _, tc := range []struct {
		name   string
		values map[string]any
		// want: what the error must say (the value's path, or the unknown key).
		want []string
	}{
		// Durations: a Go duration string, never a bare number.
		{"healthEventsInterval a number", map[string]any{"resizer": map[string]any{"healthEventsInterval": 10}}, []string{"/resizer/healthEventsInterval"}},
		{"healthEventsInterval without a unit", map[string]any{"resizer": map[string]any{"healthEventsInterval": "10"}}, []string{"/resizer/healthEventsInterval"}},
		{"healthEventsInterval in words", map[string]any{"resizer": map[string]any{"healthEventsInterval": "10 seconds"}}, []string{"/resizer/healthEventsInterval"}},
		{"provisioner.timeout a number", map[string]any{"provisioner": map[string]any{"timeout": 60}}, []string{"/provisioner/timeout"}},
		{"provisioner.timeout without a unit", map[string]any{"provisioner": map[string]any{"timeout": "60"}}, []string{"/provisioner/timeout"}},
		{"podMonitor.interval a number", map[string]any{"metrics": map[string]any{"podMonitor": map[string]any{"interval": 30}}}, []string{"/metrics/podMonitor/interval"}},
		{"tests.timeout without a unit", map[string]any{"tests": map[string]any{"timeout": "10"}}, []string{"/tests/timeout"}},
		{"namespace.create a string", map[string]any{"namespace": map[string]any{"create": "yes"}}, []string{"/namespace/create"}},
		{"podMonitor.labels a list", map[string]any{"metrics": map[string]any{"podMonitor": map[string]any{"labels": []any{"a"}}}}, []string{"/metrics/podMonitor/labels"}},
		{"FUSE readyTimeout a number", profile(map[string]any{"readyTimeout": 10}), []string{"/config/fuseProfiles/0/readyTimeout"}},
		// Absolute paths.
		{"relative kubeletDir", map[string]any{"kubeletDir": "var/lib/kubelet"}, []string{"/kubeletDir"}},
		{"relative stateDir", map[string]any{"stateDir": "mountplan"}, []string{"/stateDir"}},
		{"relative mounter.socketDir", map[string]any{"mounter": map[string]any{"socketDir": "run/mountplan"}}, []string{"/mounter/socketDir"}},
		{"relative mounter.recordsDir", map[string]any{"mounter": map[string]any{"recordsDir": "records"}}, []string{"/mounter/recordsDir"}},
		{"relative nri.socketPath", map[string]any{"nri": map[string]any{"socketPath": "nri.sock"}}, []string{"/nri/socketPath"}},
		{"relative imageRoot", map[string]any{"config": map[string]any{"imageRoots": []any{"srv/images"}}}, []string{"/config/imageRoots/0"}},
		{"relative FUSE root", profile(map[string]any{"source": map[string]any{"roots": []any{"srv"}}}), []string{"/config/fuseProfiles/0/source/roots/0"}},
		{"relative NBD socket root", map[string]any{"config": map[string]any{"nbd": map[string]any{"socketRoots": []any{"run/nbd"}}}}, []string{"/config/nbd/socketRoots/0"}},
		{"relative iSCSI nodeDBDir", map[string]any{"config": map[string]any{"iscsi": map[string]any{"nodeDBDir": "etc/iscsi/nodes"}}}, []string{"/config/iscsi/nodeDBDir"}},
		{"relative iSCSI initiatorNameFile", map[string]any{"config": map[string]any{"iscsi": map[string]any{"initiatorNameFile": "initiatorname.iscsi"}}}, []string{"/config/iscsi/initiatorNameFile"}},
		// Unknown keys: at the top and misspelled in closed sections.
		{"unknown top-level key", map[string]any{"kubeletDirectory": "/var/lib/kubelet"}, []string{"kubeletDirectory"}},
		{"misspelled resizer key", map[string]any{"resizer": map[string]any{"healthEventInterval": "30s"}}, []string{"healthEventInterval", "/resizer"}},
		{"misspelled mounter key", map[string]any{"mounter": map[string]any{"extraArg": []any{"--v=5"}}}, []string{"extraArg", "/mounter"}},
		{"misspelled plugin key", map[string]any{"plugin": map[string]any{"extraEnvs": []any{}}}, []string{"extraEnvs", "/plugin"}},
		{"misspelled image key", map[string]any{"image": map[string]any{"plugin": map[string]any{"pullpolicy": "Always"}}}, []string{"pullpolicy", "/image/plugin"}},
		{"misspelled config key", map[string]any{"config": map[string]any{"fuseProfile": []any{}}}, []string{"fuseProfile", "/config"}},
		{"misspelled nbd key", map[string]any{"config": map[string]any{"nbd": map[string]any{"allowedServer": []any{"a:1"}}}}, []string{"allowedServer", "/config/nbd"}},
		{"misspelled resources container", map[string]any{"resources": map[string]any{"mountr": map[string]any{}}}, []string{"mountr", "/resources"}},
		{"misspelled updateStrategy key", map[string]any{"updateStrategy": map[string]any{"rollingUpdate": map[string]any{"maxUnavaliable": 2}}}, []string{"maxUnavaliable", "/updateStrategy/rollingUpdate"}},
		{"misspelled extraEnv key", map[string]any{"plugin": map[string]any{"extraEnv": []any{map[string]any{"name": "A", "valuefrom": map[string]any{}}}}}, []string{"valuefrom", "/plugin/extraEnv/0"}},
		// Enums.
		{"unknown registration", map[string]any{"registration": "both"}, []string{"/registration"}},
		{"unknown pullPolicy", map[string]any{"image": map[string]any{"mounter": map[string]any{"pullPolicy": "Sometimes"}}}, []string{"/image/mounter/pullPolicy"}},
		{"unknown reclaimPolicy", map[string]any{"storageClass": map[string]any{"reclaimPolicy": "Recycle"}}, []string{"/storageClass/reclaimPolicy"}},
		{"unknown deletionPolicy", map[string]any{"snapshots": map[string]any{"volumeSnapshotClass": map[string]any{"deletionPolicy": "Keep"}}}, []string{"/snapshots/volumeSnapshotClass/deletionPolicy"}},
		{"unknown updateStrategy type", map[string]any{"updateStrategy": map[string]any{"type": "Rolling"}}, []string{"/updateStrategy/type"}},
		{"unknown mounter updateStrategy type", map[string]any{"mounter": map[string]any{"updateStrategy": map[string]any{"type": "Manual"}}}, []string{"/mounter/updateStrategy/type"}},
		// Types.
		{"logVerbosity a string", map[string]any{"logVerbosity": "high"}, []string{"/logVerbosity"}},
		{"healthPort out of range", map[string]any{"healthPort": 70000}, []string{"/healthPort"}},
		{"metrics.enabled a string", map[string]any{"metrics": map[string]any{"enabled": "yes"}}, []string{"/metrics/enabled"}},
		{"driverName upper case", map[string]any{"driverName": "Mountplan.CSI.io"}, []string{"/driverName"}},
		{"StorageClass parameter not a string", map[string]any{"storageClass": map[string]any{"parameters": map[string]any{"nri": true}}}, []string{"/storageClass/parameters/nri"}},
		{"podLabels value not a string", map[string]any{"podLabels": map[string]any{"tier": 1}}, []string{"/podLabels/tier"}},
		{"extraArgs a string", map[string]any{"plugin": map[string]any{"extraArgs": "--reboot-grace=1h"}}, []string{"/plugin/extraArgs"}},
		{"extraArgs item a number", map[string]any{"resizer": map[string]any{"extraArgs": []any{8}}}, []string{"/resizer/extraArgs/0"}},
		{"extraArgs item not a flag", map[string]any{"mounter": map[string]any{"extraArgs": []any{"--nri-timeout", "3s"}}}, []string{"/mounter/extraArgs/1"}},
		{"extraEnv item a string", map[string]any{"mounter": map[string]any{"extraEnv": []any{"A=b"}}}, []string{"/mounter/extraEnv/0"}},
		{"extraEnv item without a name", map[string]any{"resizer": map[string]any{"extraEnv": []any{map[string]any{"value": "b"}}}}, []string{"/resizer/extraEnv/0"}},
		{"maxUnavailable a bad string", map[string]any{"plugin": map[string]any{"updateStrategy": map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": "half"}}}}, []string{"/plugin/updateStrategy/rollingUpdate/maxUnavailable"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := chartrender.Render(chartDir, tc.values)
			if err == nil {
				t.Fatalf("values %v rendered without error", tc.values)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the error does not name %s:\n%v", w, err)
				}
			}
			var lintErr []string
			for _, m := range lint.AllWithKubeVersion(chartDir, tc.values, chartrender.Namespace, kv).Messages {
				if m.Severity == support.ErrorSev {
					lintErr = append(lintErr, m.Error())
				}
			}
			if !slices.ContainsFunc(lintErr, func(e string) bool { return strings.Contains(e, tc.want[0]) }) {
				t.Errorf("helm lint reports no error naming %s: %q", tc.want[0], lintErr)
			}
		})
	}
}

// durationPattern is the schema's pattern of a Go duration.
func durationPattern(t *testing.T) *regexp.Regexp {
	t.Helper()
	defs, _ := readSchema(t)["definitions"].(map[string]any)
	d, _ := defs["duration"].(map[string]any)
	p, _ := d["pattern"].(string)
	if p == "" {
		t.Fatalf("values.schema.json has no definitions.duration.pattern: %v", d)
	}
	return regexp.MustCompile(p)
}

// TestSchemaDurationPattern: what the schema takes for a duration, Go's
// time.ParseDuration (the binaries' flags, the plugin's config) takes too.
func TestSchemaDurationPattern(t *testing.T) {
	re := durationPattern(t)
	for _, s := range []string{"0", "0s", "10s", "1m30s", "1.5h", "250ms", "100us", "100µs", "100μs", "10ns", "2h45m"} {
		if !re.MatchString(s) {
			t.Errorf("the duration pattern rejects %q", s)
		}
		if _, err := time.ParseDuration(s); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	for _, s := range []string{"", "10", "s", "10 s", "10sec", "1d", "-1s", "10s ", "60s --v=9", "1,5s"} {
		if re.MatchString(s) {
			t.Errorf("the duration pattern takes %q", s)
		}
	}
}

// extraValues sets extra args and env of every container that takes them,
// each with a flag the binary defines and a distinct env name.
var extraValues = map[string]any{
	"nri": map[string]any{"enabled": true},
	"plugin": map[string]any{
		"extraArgs": []any{"--reboot-grace=1h", "--reconcile-interval=30s"},
		"extraEnv":  []any{map[string]any{"name": "PLUGIN_EXTRA", "value": "p"}},
	},
	"mounter": map[string]any{
		"extraArgs": []any{"--nri-timeout=3s"},
		"extraEnv": []any{map[string]any{"name": "MOUNTER_EXTRA", "valueFrom": map[string]any{
			"fieldRef": map[string]any{"fieldPath": "status.hostIP"}}}},
	},
	"resizer": map[string]any{
		"extraArgs": []any{"--workers=8"},
		"extraEnv":  []any{map[string]any{"name": "RESIZER_EXTRA", "value": "r"}},
	},
	"provisioner": map[string]any{
		"extraArgs": []any{"--kube-api-qps=50", "--kube-api-burst=100"},
		"extraEnv":  []any{map[string]any{"name": "PROVISIONER_EXTRA", "value": "q"}},
	},
}

func init() {
	// Every invariant of the other tests (flags the binaries define, no flag
	// twice, lint, the threat model) holds with extra args and env too.
	valueSets = append(valueSets, struct {
		name   string
		values map[string]any
	}{"extraArgsEnv", extraValues})
}

// TestExtraArgsEnv: each container's extraArgs follow the chart's own
// arguments, in order, and its extraEnv follows its own env; no other
// container of either DaemonSet gets them.
func TestExtraArgsEnv(t *testing.T) {
	r := render(t, extraValues)
	def := render(t, map[string]any{"nri": map[string]any{"enabled": true}})
	want := map[string]struct {
		key  string
		args []string
		env  []corev1.EnvVar
	}{
		"plugin":          {"plugin", []string{"--reboot-grace=1h", "--reconcile-interval=30s"}, []corev1.EnvVar{{Name: "PLUGIN_EXTRA", Value: "p"}}},
		"mounter":         {"mounter", []string{"--nri-timeout=3s"}, []corev1.EnvVar{{Name: "MOUNTER_EXTRA", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.hostIP"}}}}},
		"resizer":         {"resizer", []string{"--workers=8"}, []corev1.EnvVar{{Name: "RESIZER_EXTRA", Value: "r"}}},
		"csi-provisioner": {"provisioner", []string{"--kube-api-qps=50", "--kube-api-burst=100"}, []corev1.EnvVar{{Name: "PROVISIONER_EXTRA", Value: "q"}}},
	}
	for _, c := range r.containers() {
		d := def.container(t, c.Name)
		w, ok := want[c.Name]
		if !ok {
			// Not one that takes extras: exactly as without them.
			if !slices.Equal(c.Args, d.Args) || !slices.EqualFunc(c.Env, d.Env, envEqual) {
				t.Errorf("container %s: args %q env %v, want %q %v as without extras", c.Name, c.Args, c.Env, d.Args, d.Env)
			}
			continue
		}
		if got := c.Args; !slices.Equal(got, append(slices.Clone(d.Args), w.args...)) {
			t.Errorf("container %s: args %q, want its own %q then %s.extraArgs %q", c.Name, got, d.Args, w.key, w.args)
		}
		if got := c.Env; !slices.EqualFunc(got, append(slices.Clone(d.Env), w.env...), envEqual) {
			t.Errorf("container %s: env %+v, want its own %+v then %s.extraEnv %+v", c.Name, got, d.Env, w.key, w.env)
		}
		delete(want, c.Name)
	}
	for name := range want {
		t.Errorf("no container %s rendered", name)
	}
	// The resizer off: its extras go nowhere.
	off := render(t, map[string]any{"resizer": map[string]any{"enabled": false, "extraArgs": []any{"--workers=8"},
		"extraEnv": []any{map[string]any{"name": "RESIZER_EXTRA", "value": "r"}}}})
	if strings.Contains(off.text, "--workers=8") || strings.Contains(off.text, "RESIZER_EXTRA") {
		t.Error("resizer.enabled false, but the resizer's extras are rendered")
	}
}

func envEqual(a, b corev1.EnvVar) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// TestUpdateStrategyPerDaemonSet: updateStrategy serves both DaemonSets
// unless plugin.updateStrategy (<fullname>-node) or mounter.updateStrategy
// (<fullname>-mounter) is set, which then replaces it for that one alone.
func TestUpdateStrategyPerDaemonSet(t *testing.T) {
	rolling1 := `{"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":1}}`
	for _, tc := range []struct {
		name          string
		values        map[string]any
		node, mounter string
	}{
		{"default", nil, rolling1, rolling1},
		{"shared", map[string]any{"updateStrategy": map[string]any{"rollingUpdate": map[string]any{"maxUnavailable": "25%"}}},
			`{"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":"25%"}}`, `{"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":"25%"}}`},
		{"mounter OnDelete", map[string]any{"mounter": map[string]any{"updateStrategy": map[string]any{"type": "OnDelete"}}},
			rolling1, `{"type":"OnDelete"}`},
		{"plugin", map[string]any{"plugin": map[string]any{"updateStrategy": map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": "10%", "maxSurge": 0}}}},
			`{"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":"10%","maxSurge":0}}`, rolling1},
		{"both", map[string]any{"plugin": map[string]any{"updateStrategy": map[string]any{"type": "OnDelete"}},
			"mounter": map[string]any{"updateStrategy": map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": 3}}}},
			`{"type":"OnDelete"}`, `{"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":3}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := render(t, tc.values)
			for _, c := range []struct {
				ds   *appsv1.DaemonSet
				want string
			}{{r.ds, tc.node}, {r.mds, tc.mounter}} {
				var want appsv1.DaemonSetUpdateStrategy
				if err := json.Unmarshal([]byte(c.want), &want); err != nil {
					t.Fatal(err)
				}
				got, _ := json.Marshal(c.ds.Spec.UpdateStrategy)
				wantJSON, _ := json.Marshal(want)
				if string(got) != string(wantJSON) {
					t.Errorf("%s: updateStrategy %s, want %s", c.ds.Name, got, wantJSON)
				}
			}
		})
	}
}

// TestSchemaCoversValues walks values.yaml along the schema: every key of
// values.yaml is described (a property with a type, or a key of a map the
// schema declares free-form with additionalProperties), and every object of
// the schema with properties says whether other keys are allowed. A key
// added to values.yaml without its schema entry fails here.
func TestSchemaCoversValues(t *testing.T) {
	schema := readSchema(t)
	if s, _ := schema["$schema"].(string); !strings.Contains(s, "draft-07") {
		t.Errorf("$schema %q: want JSON Schema draft-07", s)
	}
	defs, _ := schema["definitions"].(map[string]any)
	values, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	w := &schemaWalk{t: t, defs: defs}
	w.value("", values.AsMap(), schema)
	w.schemaNode("", schema, map[string]bool{})
	sort.Strings(w.open)
	t.Logf("values.yaml: %d keys described by the schema; free-form maps: %s", w.keys, strings.Join(w.open, ", "))
}

type schemaWalk struct {
	t    *testing.T
	defs map[string]any
	keys int
	open []string
}

// resolve follows a local "#/definitions/NAME" $ref.
func (w *schemaWalk) resolve(s map[string]any) map[string]any {
	for i := 0; i < 10; i++ {
		ref, ok := s["$ref"].(string)
		if !ok {
			return s
		}
		name, ok := strings.CutPrefix(ref, "#/definitions/")
		d, _ := w.defs[name].(map[string]any)
		if !ok || d == nil {
			w.t.Fatalf("$ref %q: not a definition of values.schema.json", ref)
		}
		s = d
	}
	w.t.Fatalf("$ref loop")
	return nil
}

// typed: the schema says what the value is (a type, an enum or a const, or
// alternatives that each do).
func (w *schemaWalk) typed(s map[string]any) bool {
	s = w.resolve(s)
	if _, ok := s["type"]; ok {
		return true
	}
	if _, ok := s["enum"]; ok {
		return true
	}
	if _, ok := s["const"]; ok {
		return true
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		if alts, ok := s[k].([]any); ok && len(alts) > 0 {
			for _, a := range alts {
				if m, ok := a.(map[string]any); !ok || !w.typed(m) {
					return false
				}
			}
			return true
		}
	}
	return false
}

// value checks one value of values.yaml at path against schema s.
func (w *schemaWalk) value(path string, v any, s map[string]any) {
	s = w.resolve(s)
	if !w.typed(s) {
		w.t.Errorf("values.yaml %s: the schema gives no type", orRoot(path))
	}
	switch v := v.(type) {
	case map[string]any:
		props, _ := s["properties"].(map[string]any)
		for k, sub := range v {
			p := strings.TrimPrefix(path+"."+k, ".")
			if ps, ok := props[k].(map[string]any); ok {
				w.keys++
				w.value(p, sub, ps)
				continue
			}
			switch ap := s["additionalProperties"].(type) {
			case bool:
				if ap {
					w.keys++
					continue
				}
			case map[string]any:
				w.keys++
				w.value(p, sub, ap)
				continue
			}
			w.t.Errorf("values.yaml %s: not described by values.schema.json (add it to the schema)", p)
		}
	case []any:
		items, ok := s["items"].(map[string]any)
		if !ok {
			w.t.Errorf("values.yaml %s: a list whose items the schema does not describe", orRoot(path))
			return
		}
		for i, it := range v {
			w.value(path+"["+itoa(i)+"]", it, items)
		}
	}
}

// schemaNode checks every object schema with properties for an explicit
// additionalProperties, and collects the free-form maps.
func (w *schemaWalk) schemaNode(path string, s map[string]any, seen map[string]bool) {
	if ref, ok := s["$ref"].(string); ok {
		if seen[ref] {
			return
		}
		seen = cloneSeen(seen)
		seen[ref] = true
		s = w.resolve(s)
	}
	props, hasProps := s["properties"].(map[string]any)
	ap, hasAP := s["additionalProperties"]
	if hasProps && !hasAP {
		w.t.Errorf("values.schema.json %s: properties without additionalProperties (false to catch typos, true for a free-form map)", orRoot(path))
	}
	if hasAP && ap != false && path != "" {
		w.open = append(w.open, path)
	}
	for k, p := range props {
		if m, ok := p.(map[string]any); ok {
			w.schemaNode(strings.TrimPrefix(path+"."+k, "."), m, seen)
		}
	}
	if m, ok := s["items"].(map[string]any); ok {
		w.schemaNode(path+"[]", m, seen)
	}
	if m, ok := ap.(map[string]any); ok {
		w.schemaNode(path+".*", m, seen)
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		if alts, ok := s[k].([]any); ok {
			for _, a := range alts {
				if m, ok := a.(map[string]any); ok {
					w.schemaNode(path, m, seen)
				}
			}
		}
	}
}

func cloneSeen(m map[string]bool) map[string]bool {
	c := make(map[string]bool, len(m)+1)
	for k, v := range m {
		c[k] = v
	}
	return c
}

func orRoot(path string) string {
	if path == "" {
		return "(root)"
	}
	return path
}

func itoa(i int) string {
	b, _ := json.Marshal(i)
	return string(b)
}
