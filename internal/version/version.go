// Package version says which build of mountplan runs: every binary's
// --version, the plugin's CSI vendor_version and its mountplan_build_info
// metric read it here, so that they cannot disagree.
//
// The build sets it (the Makefile's build and the Dockerfile's builder):
//
//	go build -ldflags "-X github.com/mountplan/mountplan/internal/version.version=v0.1.0 \
//	  -X github.com/mountplan/mountplan/internal/version.revision=$(git rev-parse HEAD) \
//	  -X github.com/mountplan/mountplan/internal/version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
//
// A build without them (go build, go install, go test) still tells itself
// apart by what Go stamps into it (runtime/debug.ReadBuildInfo): built in a
// git checkout, the revision, whether the checkout was modified, and a
// pseudo-version of the commit (v0.0.0-<date>-<revision>[+dirty]); built
// as a dependency, the module's version. Else the version is "devel" and
// the revision unknown (go test, -buildvcs=false, a tree without .git).
package version

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// Set with -ldflags -X (see the package comment); empty when not.
var (
	version   string
	revision  string
	buildDate string
)

// Devel is the version of a build that was given none.
const Devel = "devel"

// Info is what a build knows of itself.
type Info struct {
	// Version is the release (git describe), Go's stamp, or Devel.
	Version string
	// Revision is the git commit, "" when unknown (a build outside a
	// checkout, or with -buildvcs=false, and no -ldflags).
	Revision string
	// Modified: the checkout had changes not committed (known only from
	// Go's stamp; a Makefile build says so in its version, git describe
	// --dirty).
	Modified bool
	// BuildDate is when it was built (RFC 3339), "" when unknown.
	BuildDate string
	// GoVersion is the Go release that built it.
	GoVersion string
}

// Get returns this binary's build information.
func Get() Info {
	i := Info{Version: version, Revision: revision, BuildDate: buildDate, GoVersion: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		if i.Version == "" {
			i.Version = Devel
		}
		return i
	}
	if i.Version == "" {
		// "(devel)" is what Go says of the main module when it stamped
		// no version (no VCS information).
		i.Version = Devel
		if v := bi.Main.Version; v != "" && v != "(devel)" {
			i.Version = v
		}
	}
	if i.Revision == "" {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				i.Revision = s.Value
			case "vcs.modified":
				i.Modified = s.Value == "true"
			}
		}
	}
	return i
}

// Print writes what --version prints: the binary's name and version,
// then the revision, the build date when known, and the Go version, one a
// line.
func (i Info) Print(w io.Writer, name string) {
	fmt.Fprintf(w, "%s %s\n", name, i.Version)
	rev := i.Revision
	switch {
	case rev == "":
		rev = "unknown"
	case i.Modified:
		rev += " (modified)"
	}
	fmt.Fprintf(w, "revision: %s\n", rev)
	if i.BuildDate != "" {
		fmt.Fprintf(w, "build date: %s\n", i.BuildDate)
	}
	fmt.Fprintf(w, "go: %s\n", i.GoVersion)
}
