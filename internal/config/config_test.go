package config

import (
	"os"
	"path/filepath"
	"testing"
)

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write := func(s string) string {
		p := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c, err := Load("")
	if err != nil || c.DefaultFsType != "ext4" || len(c.ImageRoots) != 0 {
		t.Fatalf("defaults: %+v %v", c, err)
	}
	c, err = Load(write("imageRoots: [/srv/images]\nmountPolicy: {allowSuidDev: true}\ndefaultFsType: xfs\n"))
	if err != nil || c.ImageRoots[0] != "/srv/images" || !c.MountPolicy.AllowSuidDev || c.DefaultFsType != "xfs" {
		t.Fatalf("parsed: %+v %v", c, err)
	}
	for _, bad := range []string{"imageRoot: [/x]\n", "imageRoots: [relative]\n", "imageRoots: [/]\n", "imageRoots: [/a/../b]\n"} {
		if _, err := Load(write(bad)); err == nil {
			t.Errorf("Load(%q) accepted", bad)
		}
	}
}
