package chart_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// sidecarFlags lists the flags of the pinned kubernetes-csi sidecars that the
// chart may pass, read from their sources at those tags (cmd/*/main.go; the
// logging flags come from component-base logsapi). Bumping an image tag in
// values.yaml fails TestSidecarFlags until the new release's flags are checked
// and the tag here is updated.
var sidecarFlags = map[string]struct {
	tag   string
	flags []string
}{
	"registry.k8s.io/sig-storage/csi-node-driver-registrar": {"v2.17.0", []string{
		"csi-address", "kubelet-registration-path", "plugin-registration-path", "timeout",
		"health-port", "http-endpoint", "enable-pprof", "v", "vmodule",
	}},
	"registry.k8s.io/sig-storage/livenessprobe": {"v2.19.0", []string{
		"csi-address", "probe-timeout", "http-endpoint", "metrics-path", "v", "vmodule",
	}},
	"registry.k8s.io/sig-storage/csi-provisioner": {"v6.4.0", []string{
		"csi-address", "timeout", "feature-gates", "strict-topology", "immediate-topology",
		"extra-create-metadata", "default-fstype", "http-endpoint", "metrics-path", "worker-threads",
		"node-deployment", "node-deployment-immediate-binding", "node-deployment-base-delay",
		"node-deployment-max-delay", "enable-capacity", "capacity-ownerref-level",
		"kube-api-qps", "kube-api-burst", "v", "vmodule",
	}},
	"registry.k8s.io/sig-storage/csi-snapshotter": {"v8.7.0", []string{
		"csi-address", "timeout", "node-deployment", "extra-create-metadata", "worker-threads",
		"resync-period", "snapshot-name-prefix", "snapshot-name-uuid-length",
		"retry-interval-start", "retry-interval-max", "feature-gates", "http-endpoint", "v", "vmodule",
	}},
}

// pendingFlags are flags the chart passes that the binaries do not define yet:
// they are reported, not failed, and should be removed from here once defined.
var pendingFlags = map[string]string{}

func TestSidecarFlags(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		for _, c := range r.containers() {
			repo, tag, _ := strings.Cut(c.Image, ":")
			known, ok := sidecarFlags[repo]
			if !ok {
				continue
			}
			if tag != known.tag {
				t.Errorf("container %s runs %s: its flags were checked for %s; check them again and update sidecarFlags", c.Name, c.Image, known.tag)
			}
			for _, f := range flagNames(c) {
				if !contains(known.flags, f) {
					t.Errorf("container %s passes --%s, not a flag of %s:%s", c.Name, f, repo, known.tag)
				}
			}
		}
	})
}

// TestBinaryFlags checks every flag the chart passes to mountplan-plugin and
// mountplan-sidecar against the flags their sources under cmd/ define.
func TestBinaryFlags(t *testing.T) {
	binaries := map[string]string{pluginBinary: "mountplan-plugin", sidecarBinary: "mountplan-sidecar", resizerBinary: "mountplan-resizer"}
	defined := map[string]map[string]bool{}
	for _, name := range binaries {
		fs, err := definedFlags(filepath.Join("..", "..", "cmd", name))
		if err != nil {
			t.Fatal(err)
		}
		defined[name] = fs
	}
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		for _, c := range r.containers() {
			if len(c.Command) == 0 {
				continue
			}
			name, ok := binaries[c.Command[0]]
			if !ok {
				t.Errorf("container %s runs %s, not a mountplan binary", c.Name, c.Command[0])
				continue
			}
			fs := defined[name]
			if len(fs) == 0 {
				t.Logf("cmd/%s defines no flags yet: its arguments are not checked", name)
				continue
			}
			for _, f := range flagNames(c) {
				if fs[f] {
					continue
				}
				if why, ok := pendingFlags[name+" --"+f]; ok {
					t.Logf("pending: %s does not define --%s yet (%s)", name, f, why)
					continue
				}
				t.Errorf("container %s passes --%s, which cmd/%s does not define", c.Name, f, name)
			}
		}
	})
}

// flagNames returns the names of the --flags in a container's arguments.
func flagNames(c corev1.Container) []string {
	var names []string
	for _, a := range c.Args {
		if f, ok := strings.CutPrefix(a, "--"); ok {
			f, _, _ = strings.Cut(f, "=")
			names = append(names, f)
		}
	}
	return names
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// flagMethod matches the flag and pflag definition methods; the name is the
// first string argument (the second for the *Var forms, after the pointer).
var flagMethod = regexp.MustCompile(`^(Bool|String|Int|Int64|Uint|Uint64|Float64|Duration|Func|BoolFunc|Text|StringSlice|StringArray)(Var)?P?$|^Var$`)

// definedFlags parses the non-test Go files of dir and returns the flag names
// defined there with the standard flag package, a FlagSet, or pflag. klog's
// flags count when the sources call klog.InitFlags.
func definedFlags(dir string) (map[string]bool, error) {
	flags := map[string]bool{}
	entries, err := os.ReadDir(dir)
	if err != nil {
		if os.IsNotExist(err) {
			return flags, nil
		}
		return nil, err
	}
	fset := token.NewFileSet()
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, 0)
		if err != nil {
			return nil, err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if x, ok := sel.X.(*ast.Ident); ok && x.Name == "klog" && sel.Sel.Name == "InitFlags" {
				for _, k := range []string{"v", "vmodule", "logtostderr", "alsologtostderr", "log_dir", "log_file",
					"log_file_max_size", "one_output", "skip_headers", "skip_log_headers", "stderrthreshold",
					"add_dir_header", "log_backtrace_at"} {
					flags[k] = true
				}
				return true
			}
			if !flagMethod.MatchString(sel.Sel.Name) {
				return true
			}
			for _, a := range call.Args[:min(2, len(call.Args))] {
				if lit, ok := a.(*ast.BasicLit); ok && lit.Kind == token.STRING {
					if s, err := strconv.Unquote(lit.Value); err == nil {
						flags[s] = true
					}
					break
				}
			}
			return true
		})
	}
	return flags, nil
}
