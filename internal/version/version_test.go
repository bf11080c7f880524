package version_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/testenv"
)

// The module's root, from this package's directory.
const root = "../.."

// commands are every binary an operator runs; each answers --version.
var commands = []string{"mountplan-plugin", "mountplan-sidecar", "mountplan-resizer", "kubectl-mountplan"}

const pkg = "github.com/mountplan/mountplan/internal/version"

// build builds every command into a fresh directory with extra go build
// flags and returns the directory.
func build(t *testing.T, flags ...string) string {
	t.Helper()
	out := t.TempDir()
	args := append([]string{"build", "-trimpath", "-o", out + "/"}, flags...)
	for _, c := range commands {
		args = append(args, "./cmd/"+c)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return out
}

// versionOf runs `bin --version`, which must exit 0.
func versionOf(t *testing.T, dir, bin string) string {
	t.Helper()
	b, err := exec.Command(filepath.Join(dir, bin), "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("%s --version: %v\n%s", bin, err, b)
	}
	return string(b)
}

// What the Makefile and the Dockerfile set is what every binary says.
func TestVersionFromLdflags(t *testing.T) {
	dir := build(t, "-ldflags=-X "+pkg+".version=v0.9.1-test.2 -X "+pkg+".revision=0123456789abcdef -X "+pkg+".buildDate=2026-01-02T03:04:05Z")
	for _, c := range commands {
		got := versionOf(t, dir, c)
		for _, want := range []string{c + " v0.9.1-test.2\n", "revision: 0123456789abcdef\n", "build date: 2026-01-02T03:04:05Z\n", "go: " + runtime.Version() + "\n"} {
			if !strings.Contains(got, want) {
				t.Errorf("%s --version:\n%s\nwant a line %q", c, got, strings.TrimSpace(want))
			}
		}
	}
}

// A plain `go build` in a checkout still says which commit it is: the
// revision and the version Go stamps into the binary (vcs.revision).
//
// Go stamps only a checkout whose .git is a directory: a git worktree's
// .git is a file, and a copy of the tree has none. There the binaries say
// "devel" and an unknown revision, which is checked instead.
func TestVersionFromBuildInfo(t *testing.T) {
	testenv.RequireCommands(t, "git")
	if fi, err := os.Stat(filepath.Join(root, ".git")); err != nil || !fi.IsDir() {
		t.Logf("the module is not a checkout with a .git directory (%v): Go stamps no VCS; checking what the binaries say then", err)
		dir := build(t, "-buildvcs=true")
		for _, c := range commands {
			if got := versionOf(t, dir, c); !strings.HasPrefix(got, c+" devel\nrevision: unknown\n") {
				t.Errorf("%s --version without -ldflags nor a VCS stamp:\n%s\nwant %q first", c, got, c+" devel / revision: unknown")
			}
		}
		return
	}
	t.Log("the module is a git checkout: Go stamps its revision")
	// GOFLAGS may hold -buildvcs=false (this project's CI sets it); the
	// flag on the command line wins.
	// Others may commit in the same checkout meanwhile: the binaries
	// carry HEAD as it was during the build, before or after.
	head := func() string {
		b, err := exec.Command("git", "-C", root, "rev-parse", "HEAD").Output()
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	before := head()
	dir := build(t, "-buildvcs=true")
	after := head()
	rev := regexp.MustCompile(`(?m)^revision: (` + before + `|` + after + `)( \(modified\))?$`)
	for _, c := range commands {
		got := versionOf(t, dir, c)
		// Go (1.24 and later) stamps a pseudo-version of the commit,
		// v0.0.0-<date>-<revision>[+dirty].
		if first, _, _ := strings.Cut(got, "\n"); !regexp.MustCompile(`^`+c+` \S+$`).MatchString(first) || strings.Contains(first, "(devel)") {
			t.Errorf("%s --version:\n%s\nwant it to begin with its name and a version", c, got)
		}
		if !rev.MatchString(got) {
			t.Errorf("%s --version:\n%s\nwant the checkout's revision, %s", c, got, after)
		}
		if strings.Contains(got, "build date") {
			t.Errorf("%s --version:\n%s\nno build date is known without -ldflags", c, got)
		}
	}
}
