package fuse

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// README documents the example profiles verbatim: the ones the end-to-end
// tests run.
func TestReadmeShowsTheTestedProfiles(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "..", "README.md"))
	if err != nil {
		t.Fatalf("README.md: %v", err)
	}
	profiles, err := os.ReadFile(filepath.Join("testdata", "profiles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), strings.TrimRight(string(profiles), "\n")) {
		t.Error("README's FUSE section does not show testdata/profiles.yaml verbatim; copy it over")
	}
}
