package driver

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/pkg/plan"
)

// FuzzKubeletPath: a staging or target path the driver accepts lies
// strictly under kubelet's directory, is clean and absolute, and names
// the same place as the relative path the driver walks.
func FuzzKubeletPath(f *testing.F) {
	for _, s := range []string{"/var/lib/kubelet/pods/u/volumes/v/mount", "/var/lib/kubelet", "/var/lib/kubelet/", "/var/lib/kubelet/../etc",
		"/var/lib/kubeletx/a", "/etc", "relative", "/var/lib/kubelet/a//b", "/var/lib/kubelet/a/./b", "/var/lib/kubelet/\x00", ""} {
		f.Add(s)
	}
	k := kubeletDir{root: "/var/lib/kubelet"}
	f.Fuzz(func(t *testing.T, p string) {
		rel, err := k.rel("target_path", p)
		if err != nil {
			return
		}
		if !strings.HasPrefix(p, k.root+"/") || filepath.Clean(p) != p || strings.ContainsRune(p, 0) {
			t.Fatalf("accepted %q", p)
		}
		if filepath.Join(k.root, rel) != p || rel == "" || strings.HasPrefix(rel, "/") {
			t.Fatalf("%q walks %q from %s", p, rel, k.root)
		}
		for _, part := range strings.Split(rel, "/") {
			if part == "" || part == "." || part == ".." {
				t.Fatalf("%q walks through %q", p, part)
			}
		}
	})
}

// FuzzMountFlags: a CO mount flag the driver lets through to a mount
// holds no separator, path or value outside the allow-lists.
func FuzzMountFlags(f *testing.F) {
	for _, s := range []string{"noatime", "errors=panic", "errors=remount-ro", "commit=5", "commit=5,errors=panic", "data=journal",
		"allocsize=64k", "compress=zstd:3", "dax", "lowerdir=/etc", "nosuid", "suid"} {
		f.Add("ext4", s)
	}
	f.Add("xfs", "logbsize=256k")
	f.Add("bind", "noexec")
	f.Fuzz(func(t *testing.T, typ, flag string) {
		mounts := []plan.Mount{{Type: typ, Source: "/dev/loop0", Options: []string{"nosuid", "nodev", flag}}}
		if checkMountFlags(mounts, []string{flag}) != nil {
			return
		}
		if strings.ContainsAny(flag, ",/\x00\n ") || flag == "suid" || flag == "dev" {
			t.Fatalf("%s accepted %q", typ, flag)
		}
	})
}
