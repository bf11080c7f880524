package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// krewPlugin is krew's krew.googlecontainertools.github.com/v1alpha2 Plugin,
// the fields krew-index reads; a field krew does not know fails the strict
// decode.
type krewPlugin struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Version          string `json:"version"`
		Homepage         string `json:"homepage"`
		ShortDescription string `json:"shortDescription"`
		Description      string `json:"description"`
		Caveats          string `json:"caveats"`
		Platforms        []struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			URI    string `json:"uri"`
			Sha256 string `json:"sha256"`
			Bin    string `json:"bin"`
			Files  []struct {
				From string `json:"from"`
				To   string `json:"to"`
			} `json:"files"`
		} `json:"platforms"`
	} `json:"spec"`
}

// TestKrewManifest: plugins/mountplan.yaml is a Plugin krew accepts, named
// as `kubectl mountplan` is invoked, whose every platform installs this
// command's binary, for linux and darwin on amd64 and arm64, at the
// chart's appVersion.
func TestKrewManifest(t *testing.T) {
	root := filepath.Join("..", "..")
	b, err := os.ReadFile(filepath.Join(root, "plugins", "mountplan.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var p krewPlugin
	if err := yaml.UnmarshalStrict(b, &p); err != nil {
		t.Fatalf("plugins/mountplan.yaml: %v", err)
	}
	if p.APIVersion != "krew.googlecontainertools.github.com/v1alpha2" || p.Kind != "Plugin" {
		t.Errorf("%s %s: want krew.googlecontainertools.github.com/v1alpha2 Plugin", p.APIVersion, p.Kind)
	}
	// kubectl finds kubectl-<name> on PATH: the plugin's name is the
	// binary's without the prefix, and the binary is this command's.
	bin, _ := os.Getwd()
	bin = filepath.Base(bin)
	if want := strings.TrimPrefix(bin, "kubectl-"); p.Metadata.Name != want {
		t.Errorf("metadata.name %q, want %q (the binary is %s)", p.Metadata.Name, want, bin)
	}
	chart, err := os.ReadFile(filepath.Join(root, "charts", "mountplan", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(chart, &c); err != nil {
		t.Fatal(err)
	}
	if p.Spec.Version != c.AppVersion {
		t.Errorf("spec.version %q, the chart's appVersion %q", p.Spec.Version, c.AppVersion)
	}
	if p.Spec.ShortDescription == "" || p.Spec.Homepage == "" || p.Spec.Description == "" {
		t.Error("krew-index needs shortDescription, homepage and description")
	}
	hex := regexp.MustCompile(`^[0-9a-f]{64}$`)
	var got []string
	for _, pl := range p.Spec.Platforms {
		osArch := pl.Selector.MatchLabels["os"] + "/" + pl.Selector.MatchLabels["arch"]
		got = append(got, osArch)
		if pl.Bin != bin {
			t.Errorf("%s: bin %q, want %q", osArch, pl.Bin, bin)
		}
		if !hex.MatchString(pl.Sha256) {
			t.Errorf("%s: sha256 %q is not 64 hex digits", osArch, pl.Sha256)
		}
		if want := p.Spec.Version + "_" + strings.ReplaceAll(osArch, "/", "_"); !strings.HasPrefix(pl.URI, "https://") || !strings.Contains(pl.URI, want) {
			t.Errorf("%s: uri %q does not name %s over https", osArch, pl.URI, want)
		}
		if !slices.ContainsFunc(pl.Files, func(f struct {
			From string `json:"from"`
			To   string `json:"to"`
		}) bool {
			return f.From == bin
		}) {
			t.Errorf("%s: files %v do not install %s", osArch, pl.Files, bin)
		}
	}
	slices.Sort(got)
	if want := []string{"darwin/amd64", "darwin/arm64", "linux/amd64", "linux/arm64"}; !slices.Equal(got, want) {
		t.Errorf("platforms %v, want %v", got, want)
	}
}
