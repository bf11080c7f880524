package mounter

import (
	"os"
	"path/filepath"
	"testing"
)

// TestKubeletRoot checks which kubelet dir a mount point in the mounter's
// own namespace is resolved below: the dir as given first, its symlinks
// resolved only for a mount point that is not below it as given, and none
// for the dir itself or anything outside. No privileges needed.
func TestKubeletRoot(t *testing.T) {
	base := t.TempDir()
	real := filepath.Join(base, "real")
	if err := os.Mkdir(real, 0o750); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	rows := []struct {
		name, kubeletDir, p, want string
	}{
		{"below the dir", real, real + "/pods/u/mount", real},
		{"the dir itself", real, real, ""},
		{"outside", real, base + "/other/mount", ""},
		{"a prefix that is not a parent", real, real + "x/mount", ""},
		{"no kubelet dir", "", real + "/pods/u/mount", ""},
		{"below a symlinked dir as given", link, link + "/pods/u/mount", link},
		{"below a symlinked dir as resolved", link, real + "/pods/u/mount", real},
		{"the symlinked dir resolved itself", link, real, ""},
		{"unclean as given", real + "/", real + "/pods/mount", real},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			e := &Executor{KubeletDir: r.kubeletDir}
			if got := e.kubeletRoot(r.p); got != r.want {
				t.Fatalf("kubeletRoot(%q) with KubeletDir %q = %q, want %q", r.p, r.kubeletDir, got, r.want)
			}
		})
	}
}
