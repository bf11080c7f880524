package chart_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/preflight"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/dockerfile"
)

var (
	repoRoot       = filepath.Join("..", "..")
	dockerfilePath = filepath.Join(repoRoot, "Dockerfile")
)

// execTools is the one table of external programs mountplan runs on a node and
// the Debian (bookworm) package that ships each. TestDockerfileTools checks
// that the runtime image installs every package listed here, and
// TestExecToolsListed that every program the code under internal/, pkg/ and cmd/ runs is
// listed. The package of each tool was checked with dpkg -S on bookworm;
// TestExecToolsPackages repeats that check where the tool is installed.
var execTools = []struct {
	tool, pkg, usedFor string
}{
	{"mkfs.ext4", "e2fsprogs", "format ext4 (internal/fsutil)"},
	{"resize2fs", "e2fsprogs", "expand ext4 (internal/fsutil)"},
	{"e2fsck", "e2fsprogs", "check ext4 before a resize"},
	{"blkid", "util-linux", "detect filesystems (internal/fsutil)"},
	{"fsck", "util-linux", "filesystem check front end"},
	{"mkfs.xfs", "xfsprogs", "format xfs (internal/fsutil)"},
	{"xfs_growfs", "xfsprogs", "expand xfs (internal/fsutil)"},
	{"xfs_repair", "xfsprogs", "check xfs"},
	{"xfs_admin", "xfsprogs", "a UUID of its own for a copied xfs (internal/fsutil)"},
	{"mount", "mount", "fallback mounts, FUSE helpers"},
	{"umount", "mount", "fallback unmounts"},
	{"losetup", "mount", "loop device fallback and diagnostics"},
	{"fusermount3", "fuse3", "unmount FUSE daemons' mounts"},
	{"sshfs", "sshfs", "FUSE profile"},
	{"rclone", "rclone", "FUSE profile"},
	{"squashfuse", "squashfuse", "FUSE profile"},
	{"iscsiadm", "open-iscsi", "type iscsi"},
}

// Packages installed for a reason other than a tool the code runs.
var extraPackages = map[string]string{
	"ca-certificates": "TLS for rclone and other FUSE daemons",
}

func parseDockerfile(t *testing.T, file string) []dockerfile.Stage {
	t.Helper()
	stages, err := dockerfile.Parse(file)
	if err != nil {
		t.Fatal(err)
	}
	return stages
}

func TestDockerfilePinnedBases(t *testing.T) {
	stages := parseDockerfile(t, dockerfilePath)
	names := map[string]bool{}
	for _, s := range stages {
		if names[s.From] {
			continue // a previous stage
		}
		ref := s.From
		switch {
		case strings.Contains(ref, "$"):
			t.Errorf("FROM %s: base image from a build argument is not pinned", ref)
		case strings.Contains(ref, "@sha256:"):
		default:
			i := strings.LastIndex(ref, ":")
			if i < 0 || strings.Contains(ref[i:], "/") {
				t.Errorf("FROM %s: no tag (implicitly latest)", ref)
			} else if tag := ref[i+1:]; tag == "latest" || tag == "" {
				t.Errorf("FROM %s: not pinned", ref)
			}
		}
		if s.Name != "" {
			names[s.Name] = true
		}
	}
	if len(stages) < 2 {
		t.Errorf("the Dockerfile has %d stage(s), want a builder and a runtime stage", len(stages))
	}
	if final := stages[len(stages)-1].From; !strings.HasPrefix(final, "debian:") || !strings.Contains(final, "slim") {
		t.Errorf("runtime stage FROM %s, want a Debian slim image", final)
	}
}

func TestDockerfileBinaries(t *testing.T) {
	stages := parseDockerfile(t, dockerfilePath)
	final := stages[len(stages)-1]

	// The builder builds the commands statically and reproducibly.
	built := map[string]string{} // output path → package
	for _, b := range dockerfile.GoBuilds(stages[:len(stages)-1]) {
		if !slices.Contains(b.Env, "CGO_ENABLED=0") {
			t.Errorf("Dockerfile:%d: go build without CGO_ENABLED=0: %q %q", b.Line, b.Env, b.Flags)
		}
		if !slices.Contains(b.Flags, "-trimpath") {
			t.Errorf("Dockerfile:%d: go build without -trimpath: %q", b.Line, b.Flags)
		}
		built[b.Out] = b.Package
	}
	for _, c := range []string{"mountplan-plugin", "mountplan-sidecar", "mountplan-resizer"} {
		found := false
		for out, pkg := range built {
			found = found || (path.Base(out) == c && pkg == "./cmd/"+c)
		}
		if !found {
			t.Errorf("the builder stage does not build ./cmd/%s into a file named %s (builds: %v)", c, c, built)
		}
	}

	// The runtime stage copies them to the paths the chart runs.
	installed := map[string]bool{}
	for dst := range dockerfile.Copies(final) {
		installed[dst] = true
	}
	r := render(t, nil)
	for _, c := range r.containers() {
		if len(c.Command) > 0 && strings.HasPrefix(c.Image, r.str(t, "image.plugin.repository")) && !installed[c.Command[0]] {
			t.Errorf("container %s runs %s, which the Dockerfile does not install (installs %v)", c.Name, c.Command[0], installed)
		}
	}
	for _, b := range []string{pluginBinary, sidecarBinary, resizerBinary} {
		if !installed[b] {
			t.Errorf("the runtime stage does not copy %s", b)
		}
	}
}

func TestDockerfileTools(t *testing.T) {
	stages := parseDockerfile(t, dockerfilePath)
	pkgs, noRecommends := dockerfile.AptInstalls(stages[len(stages)-1])
	if !noRecommends {
		t.Error("the runtime stage runs apt-get install without --no-install-recommends")
	}
	installed := map[string]bool{}
	for _, p := range pkgs {
		installed[p] = true
	}
	needed := map[string]bool{}
	for _, e := range execTools {
		needed[e.pkg] = true
		if !installed[e.pkg] {
			t.Errorf("%s (%s) needs package %s, which the runtime stage does not install", e.tool, e.usedFor, e.pkg)
		}
	}
	for p := range extraPackages {
		needed[p] = true
	}
	for _, p := range pkgs {
		if !needed[p] {
			t.Errorf("the runtime stage installs %s, which no tool in execTools needs: add the tool or drop the package", p)
		}
	}
}

// TestExecToolsPackages checks the table's packages against dpkg where the
// tools are installed on the test machine (a Debian host); elsewhere it
// skips, and fails under CI=true (CI is Debian).
func TestExecToolsPackages(t *testing.T) {
	testenv.RequireCommands(t, "dpkg-query") // a Debian host
	checked := 0
	for _, e := range execTools {
		out, err := exec.Command("dpkg-query", "-S", "*bin/"+e.tool).Output()
		if err != nil {
			t.Logf("%s: not installed here, package not checked", e.tool)
			continue
		}
		var owners []string
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			pkgs, file, ok := strings.Cut(line, ": ")
			if !ok || path.Base(file) != e.tool {
				continue
			}
			for _, p := range strings.Split(pkgs, ", ") {
				p, _, _ = strings.Cut(p, ":") // pkg:arch
				owners = append(owners, p)
			}
		}
		if len(owners) == 0 {
			continue
		}
		checked++
		if !slices.Contains(owners, e.pkg) {
			t.Errorf("%s is shipped by %v here, the table says %s", e.tool, owners, e.pkg)
		}
	}
	t.Logf("%d of %d tools checked against dpkg", checked, len(execTools))
}

// TestExecToolsListed finds the programs that the Go code under internal/, pkg/ and cmd/
// runs and checks that execTools lists each of them.
func TestExecToolsListed(t *testing.T) {
	found, declared, unresolved, err := findExecTools(repoRoot, []string{"internal", "pkg", "cmd"})
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, e := range execTools {
		listed[e.tool] = true
		// A Tool's Package is what its "not installed" error names.
		if pkg, ok := declared[e.tool]; ok && pkg != e.pkg {
			t.Errorf("%s: toolrun.Tool %s says Debian package %q, execTools %q", found[e.tool][0], e.tool, pkg, e.pkg)
		}
	}
	var names []string
	for name := range found {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if !listed[path.Base(name)] {
			t.Errorf("%s runs %q, which execTools does not list: add it with its Debian package (and to the Dockerfile)", found[name][0], name)
		}
	}
	for _, u := range unresolved {
		t.Errorf("%s: cannot tell which program this runs; use a string literal or constant for the name so the image can be checked", u)
	}
	t.Logf("programs run by internal/, pkg/ and cmd/: %v", names)
}

// findExecTools parses the non-test Go files under dirs (skipping test helper
// packages, whose directory name ends in "test", and internal/testenv) and returns the program names
// passed to Command/CommandContext/LookPath (of os/exec or k8s.io/utils/exec),
// directly or through wrapper functions of the same package that pass one of
// their parameters on, and those declared as toolrun.Tool values (declared:
// name → the Debian package the Tool says ships it). A name is resolved from a
// string literal, a constant, or the literals assigned to a local variable.
func findExecTools(root string, dirs []string) (found map[string][]string, declared map[string]string, unresolved []string, err error) {
	fset := token.NewFileSet()
	pkgs := map[string][]*ast.File{}
	for _, d := range dirs {
		err := filepath.WalkDir(filepath.Join(root, d), func(p string, de fs.DirEntry, err error) error {
			if err != nil {
				if os.IsNotExist(err) {
					return nil
				}
				return err
			}
			if de.IsDir() {
				if de.Name() != d && (strings.HasSuffix(de.Name(), "test") || de.Name() == "testenv" || de.Name() == "testdata") {
					return filepath.SkipDir
				}
				return nil
			}
			if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return nil
			}
			f, err := parser.ParseFile(fset, p, nil, 0)
			if err != nil {
				return err
			}
			pkgs[filepath.Dir(p)] = append(pkgs[filepath.Dir(p)], f)
			return nil
		})
		if err != nil {
			return nil, nil, nil, err
		}
	}

	found, declared = map[string][]string{}, map[string]string{}
	for dir, files := range pkgs {
		if filepath.Base(dir) == "toolrun" {
			continue // the runner: it runs what the Tool values elsewhere name
		}
		consts := map[string]string{}
		for _, f := range files {
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i < len(vs.Values) {
							if s, ok := stringLit(vs.Values[i]); ok {
								consts[n.Name] = s
							}
						}
					}
				}
			}
		}
		// How each file imports the exec packages: os/exec's local name, and
		// whether it uses k8s.io/utils/exec (whose Command is an interface method).
		osExec, utilExec := map[*ast.File]string{}, map[*ast.File]bool{}
		for _, f := range files {
			for _, im := range f.Imports {
				switch p, _ := strconv.Unquote(im.Path.Value); {
				case p == "os/exec" && im.Name != nil:
					osExec[f] = im.Name.Name
				case p == "os/exec":
					osExec[f] = "exec"
				case p == "k8s.io/utils/exec":
					utilExec[f] = true
				}
			}
			// Tools declared for internal/toolrun's runner: toolrun.Tool{Name: ..., Package: ...}.
			ast.Inspect(f, func(n ast.Node) bool {
				lit, ok := n.(*ast.CompositeLit)
				if !ok || !isToolType(lit.Type) {
					return true
				}
				var name, pkg string
				for _, e := range lit.Elts {
					kv, ok := e.(*ast.KeyValueExpr)
					if !ok {
						continue
					}
					k, _ := kv.Key.(*ast.Ident)
					v, isLit := stringLit(kv.Value)
					if c, isConst := kv.Value.(*ast.Ident); !isLit && isConst {
						v, isLit = consts[c.Name], consts[c.Name] != ""
					}
					switch {
					case k == nil || !isLit:
					case k.Name == "Name":
						name = v
					case k.Name == "Package":
						pkg = v
					}
				}
				desc := fset.Position(lit.Pos()).String()
				if name == "" {
					unresolved = append(unresolved, desc)
					return true
				}
				found[name] = append(found[name], desc)
				declared[name] = pkg
				return true
			})
		}
		// wrappers: function name → index of the argument that names the program.
		wrappers := map[string]int{}
		type site struct {
			fn   *ast.FuncDecl
			arg  ast.Expr
			desc string
		}
		collect := func() (sites []site) {
			for _, f := range files {
				for _, decl := range f.Decls {
					fn, ok := decl.(*ast.FuncDecl)
					if !ok || fn.Body == nil {
						continue
					}
					ast.Inspect(fn.Body, func(n ast.Node) bool {
						call, ok := n.(*ast.CallExpr)
						if !ok {
							return true
						}
						name, idx := "", -1
						execCall := false // a Command of os/exec or of k8s.io/utils/exec
						switch fun := call.Fun.(type) {
						case *ast.SelectorExpr:
							name = fun.Sel.Name
							x, isIdent := fun.X.(*ast.Ident)
							execCall = utilExec[f] || isIdent && osExec[f] == x.Name
						case *ast.Ident:
							name = fun.Name
						}
						switch {
						case !execCall:
						case name == "Command" || name == "LookPath":
							idx = 0
						case name == "CommandContext":
							idx = 1
						}
						if i, ok := wrappers[name]; ok && idx < 0 {
							idx = i
						}
						if idx >= 0 && idx < len(call.Args) {
							sites = append(sites, site{fn, call.Args[idx], fset.Position(call.Pos()).String()})
						}
						return true
					})
				}
			}
			return sites
		}
		// Iterate until no new wrapper appears.
		for {
			before := len(wrappers)
			for _, s := range collect() {
				if id, ok := s.arg.(*ast.Ident); ok {
					if i := paramIndex(s.fn, id.Name); i >= 0 {
						wrappers[s.fn.Name.Name] = i
					}
				}
			}
			if len(wrappers) == before {
				break
			}
		}
		for _, s := range collect() {
			names, ok := resolveString(s.fn, s.arg, consts)
			if id, isIdent := s.arg.(*ast.Ident); isIdent && paramIndex(s.fn, id.Name) >= 0 {
				continue // a wrapper's parameter: resolved at its call sites
			}
			if !ok {
				unresolved = append(unresolved, s.desc)
				continue
			}
			for _, n := range names {
				found[n] = append(found[n], s.desc)
			}
		}
	}
	return found, declared, unresolved, nil
}

// isToolType says whether a composite literal's type is internal/toolrun's Tool.
func isToolType(e ast.Expr) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != "Tool" {
		return false
	}
	x, ok := sel.X.(*ast.Ident)
	return ok && x.Name == "toolrun"
}

func stringLit(e ast.Expr) (string, bool) {
	lit, ok := e.(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(lit.Value)
	return s, err == nil
}

// paramIndex returns the position of a named parameter of fn, or -1.
func paramIndex(fn *ast.FuncDecl, name string) int {
	i := 0
	for _, field := range fn.Type.Params.List {
		if len(field.Names) == 0 {
			i++
			continue
		}
		for _, n := range field.Names {
			if n.Name == name {
				return i
			}
			i++
		}
	}
	return -1
}

// resolveString returns the string values e can have: a literal, a constant,
// or every literal or constant assigned to a local variable in fn.
func resolveString(fn *ast.FuncDecl, e ast.Expr, consts map[string]string) ([]string, bool) {
	if s, ok := stringLit(e); ok {
		return []string{s}, true
	}
	id, ok := e.(*ast.Ident)
	if !ok {
		return nil, false
	}
	if s, ok := consts[id.Name]; ok {
		return []string{s}, true
	}
	var vals []string
	ok = true
	ast.Inspect(fn.Body, func(n ast.Node) bool {
		var lhs, rhs []ast.Expr
		switch a := n.(type) {
		case *ast.AssignStmt:
			lhs, rhs = a.Lhs, a.Rhs
		case *ast.ValueSpec:
			if len(a.Values) == 0 {
				return true // var x string: the zero value, not a program
			}
			for _, n := range a.Names {
				lhs = append(lhs, n)
			}
			rhs = a.Values
		default:
			return true
		}
		for i, l := range lhs {
			if lid, isID := l.(*ast.Ident); !isID || lid.Name != id.Name {
				continue
			}
			if len(rhs) != len(lhs) {
				ok = false
				continue
			}
			if s, isLit := stringLit(rhs[i]); isLit {
				vals = append(vals, s)
			} else if c, isConst := rhs[i].(*ast.Ident); isConst && consts[c.Name] != "" {
				vals = append(vals, consts[c.Name])
			} else {
				ok = false
			}
		}
		return true
	})
	return vals, ok && len(vals) > 0
}

// TestFindExecTools checks the scanner on a fixture package.
func TestFindExecTools(t *testing.T) {
	root := t.TempDir()
	write := func(rel, src string) {
		t.Helper()
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("pkg/a/a.go", `package a

import (
	"context"
	"os"
	"os/exec"

	utilexec "k8s.io/utils/exec"
)

const daemon = "sshfs"

type tools struct{ exec utilexec.Interface }

func direct(ctx context.Context) {
	_ = exec.Command("nbd-client", "-d")
	_ = exec.CommandContext(ctx, daemon)
	_, _ = exec.LookPath("/usr/sbin/iscsiadm")
}

func (t tools) run(ctx context.Context, dev, tool string, args ...string) {
	_ = t.exec.CommandContext(ctx, tool, args...)
}

func outer(ctx context.Context, t tools, name string) { t.run(ctx, "", name) }

func chosen(ctx context.Context, t tools, xfs bool) {
	var tool string
	if xfs {
		tool = "mkfs.xfs"
	} else {
		tool = "mkfs.ext4"
	}
	t.run(ctx, "/dev/loop0", tool)
	outer(ctx, t, "fusermount3")
}

func dynamic() { _ = exec.Command(os.Args[1]) }
`)
	write("pkg/b/b.go", `package b

import "example.org/toolrun"

var losetup = toolrun.Tool{Name: "losetup", Package: "mount"}

type profile struct{}

func (profile) Command(spec, src string) string { return "" }

// Not os/exec's Command: this file does not import it.
func render(p profile, spec, src string) string { return p.Command(spec, src) }
`)
	write("pkg/toolrun/run.go", `package toolrun
import "os/exec"
type Tool struct{ Name, Package string }
func run(t Tool) { _ = exec.Command(t.Name) }
`)
	write("pkg/a/a_test.go", `package a
import "os/exec"
func helper() { _ = exec.Command("only-in-tests") }
`)
	write("pkg/a/atest/h.go", `package atest
import "os/exec"
func helper() { _ = exec.Command("unshare") }
`)
	found, declared, unresolved, err := findExecTools(root, []string{"internal", "pkg", "cmd"})
	if err != nil {
		t.Fatal(err)
	}
	if declared["losetup"] != "mount" || len(declared) != 1 {
		t.Errorf("declared tools %v, want losetup from mount", declared)
	}
	var got []string
	for n := range found {
		got = append(got, n)
	}
	sort.Strings(got)
	want := []string{"/usr/sbin/iscsiadm", "fusermount3", "losetup", "mkfs.ext4", "mkfs.xfs", "nbd-client", "sshfs"}
	if !slices.Equal(got, want) {
		t.Errorf("found %v, want %v", got, want)
	}
	if len(unresolved) != 1 || !strings.Contains(unresolved[0], "a.go:") {
		t.Errorf("unresolved %v, want the os.Args call only", unresolved)
	}
}

// TestPreflightLooksForEveryTool: the start-up check (internal/preflight)
// looks for every program the code runs, so that a missing one is said at
// start with what it disables, not in the first volume's error.
func TestPreflightLooksForEveryTool(t *testing.T) {
	found, _, _, err := findExecTools(repoRoot, []string{"internal", "pkg", "cmd"})
	if err != nil {
		t.Fatal(err)
	}
	checked := map[string]bool{}
	for _, tool := range preflight.Tools() {
		checked[tool.Name] = true
	}
	if len(found) == 0 {
		t.Fatal("no program found run by the code: the finder is broken")
	}
	for name := range found {
		if !checked[path.Base(name)] {
			t.Errorf("%s runs %s, which preflight.Tools does not look for", found[name][0], name)
		}
	}
}

// TestMakeImage: `make image` builds with docker (or podman) from the
// repository's root, passing the version the binaries report; with neither
// on PATH it fails naming both.
func TestMakeImage(t *testing.T) {
	makeBin, err := exec.LookPath("make")
	if err != nil {
		testenv.Missing(t, "make (Debian package make)")
	}
	vars := []string{"VERSION=v9.8.7", "REVISION=abc", "BUILD_DATE=2026-01-02T03:04:05Z", "IMAGE=registry.example/mountplan:t1"}
	fake := t.TempDir()
	script := "#!/bin/sh\necho \"$0 $*\" > " + filepath.Join(fake, "called") + "\n"
	if err := os.WriteFile(filepath.Join(fake, "docker"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(makeBin, append([]string{"-s", "-C", repoRoot, "image"}, vars...)...)
	cmd.Env = append(os.Environ(), "PATH="+fake)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make image with a docker on PATH: %v\n%s", err, out)
	}
	called, err := os.ReadFile(filepath.Join(fake, "called"))
	if err != nil {
		t.Fatalf("make image did not run docker: %v", err)
	}
	for _, want := range []string{" build ", "--build-arg VERSION=v9.8.7", "--build-arg REVISION=abc", "--build-arg BUILD_DATE=2026-01-02T03:04:05Z", "-t registry.example/mountplan:t1"} {
		if !strings.Contains(string(called), want) {
			t.Errorf("docker ran as %q: no %q", called, want)
		}
	}
	cmd = exec.Command(makeBin, append([]string{"-s", "-C", repoRoot, "image"}, vars...)...)
	cmd.Env = append(os.Environ(), "PATH="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "docker") || !strings.Contains(string(out), "podman") {
		t.Errorf("make image without docker and podman: %v\n%s\nwant a failure naming both", err, out)
	}
}
