package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// Packages of the project's binaries, relative to the module root.
const (
	PluginPackage  = "./cmd/mountplan-plugin"
	SidecarPackage = "./cmd/mountplan-sidecar"
)

var builds struct {
	mu   sync.Mutex
	seq  int
	byPk map[string]*buildResult
}

type buildResult struct {
	once sync.Once
	out  string // where to build
	path string
	err  error
}

// BinDir is the directory in which BuildOnce puts binaries:
// os.TempDir()/mountplan-test-bin-<pid>, one per test binary. Cleanup
// removes it.
func BinDir() string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("mountplan-test-bin-%d", os.Getpid()))
}

// BuildOnce builds the main package pkg (an import path, or a path
// relative to the module root such as "./cmd/mountplan-plugin") with `go
// build` in the module root, once per test binary, and returns the path of
// the executable, named after the package's last element. Later calls for
// the same package return the first call's result. Safe for concurrent use.
func BuildOnce(pkg string) (string, error) {
	builds.mu.Lock()
	if builds.byPk == nil {
		builds.byPk = map[string]*buildResult{}
	}
	r := builds.byPk[pkg]
	if r == nil {
		builds.seq++
		r = &buildResult{out: filepath.Join(BinDir(), fmt.Sprint(builds.seq), path.Base(pkg))}
		builds.byPk[pkg] = r
	}
	builds.mu.Unlock()

	r.once.Do(func() { r.path, r.err = build(pkg, r.out) })
	return r.path, r.err
}

func build(pkg, out string) (string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	gobin, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("building %s: %w", pkg, err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", err
	}
	goBuild := func(flags ...string) (string, error) {
		cmd := exec.Command(gobin, append(append([]string{"build"}, flags...), "-o", out, pkg)...)
		cmd.Dir = root
		var output bytes.Buffer
		cmd.Stdout, cmd.Stderr = &output, &output
		err := cmd.Run()
		return output.String(), err
	}
	output, err := goBuild()
	if err != nil && strings.Contains(output, "-buildvcs=false") {
		// git cannot tell the revision (not installed, or the checkout
		// belongs to another user): build without it.
		output, err = goBuild("-buildvcs=false")
	}
	if err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", pkg, err, strings.TrimSpace(output))
	}
	return out, nil
}

// ModuleRoot returns the directory of the go.mod that encloses the current
// directory (go test runs a test in its package's directory).
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the current directory")
		}
		dir = parent
	}
}

// BuildBinaries builds mountplan-plugin and mountplan-sidecar (once per
// test binary) and returns their paths; it fails t if either does not
// build.
func BuildBinaries(t testing.TB) (plugin, sidecar string) {
	t.Helper()
	var err error
	if plugin, err = BuildOnce(PluginPackage); err != nil {
		t.Fatal(err)
	}
	if sidecar, err = BuildOnce(SidecarPackage); err != nil {
		t.Fatal(err)
	}
	return plugin, sidecar
}

// Cleanup removes what BuildOnce built. Call it from TestMain after m.Run,
// or use Main.
func Cleanup() {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	_ = os.RemoveAll(BinDir())
	builds.byPk = nil
}

// Main runs the tests, removes the binaries BuildOnce built and exits:
//
//	func TestMain(m *testing.M) { testutil.Main(m) }
func Main(m *testing.M) {
	code := m.Run()
	Cleanup()
	os.Exit(code)
}
