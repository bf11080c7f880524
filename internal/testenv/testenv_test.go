package testenv

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// recorder records whether Missing skipped or failed; it embeds a real TB
// only for the methods Missing does not call.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()                         {}
func (r *recorder) Skipf(f string, a ...any)        { r.skipped = f }
func (r *recorder) Fatalf(format string, a ...any)  { r.failed = format }
func (r *recorder) Logf(format string, args ...any) {}

func TestMissingFailsOnlyInCI(t *testing.T) {
	for _, c := range []struct {
		ci       string
		wantFail bool
	}{{"true", true}, {"", false}, {"false", false}} {
		t.Setenv("CI", c.ci)
		r := &recorder{TB: t}
		Missing(r, "the %s device", "fuse")
		if failed := r.failed != ""; failed != c.wantFail || (r.skipped != "") == c.wantFail {
			t.Errorf("CI=%q: failed %q, skipped %q; want failed=%v", c.ci, r.failed, r.skipped, c.wantFail)
		}
	}
}

// TestInstallDepsCoversCommands: every package that provides a command the
// tests run is installed by hack/install-deps.sh, so that a fresh machine
// running it has every prerequisite Missing would otherwise report.
func TestInstallDepsCoversCommands(t *testing.T) {
	script, err := os.ReadFile("../../hack/install-deps.sh")
	if err != nil {
		t.Fatal(err)
	}
	list := regexp.MustCompile(`(?s)\npkgs=\((.*?)\n\)`).FindSubmatch(script)
	if list == nil {
		t.Fatal("hack/install-deps.sh has no pkgs=( ... ) list")
	}
	installed := map[string]bool{}
	for _, line := range strings.Split(string(list[1]), "\n") {
		line, _, _ = strings.Cut(line, "#")
		for _, p := range strings.Fields(line) {
			installed[p] = true
		}
	}
	for cmd, pkg := range CommandPackages {
		if !installed[pkg] {
			t.Errorf("the tests run %s (Debian package %s), which hack/install-deps.sh does not install", cmd, pkg)
		}
	}
}
