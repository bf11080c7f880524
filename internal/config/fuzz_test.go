package config

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/pkg/plan"
)

// FuzzParse: whatever a config file holds, Parse does not panic, and a
// config it accepts holds only what its checks promise (clean absolute
// roots, FUSE profiles that pass their own validation, no loader variable
// in a daemon's environment) and reads back the same once written out.
func FuzzParse(f *testing.F) {
	examples, err := os.ReadFile(filepath.Join("..", "source", "fuse", "testdata", "profiles.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range []string{string(examples), fuseBase, "", "imageRoots: [/srv/images]\n", "imageRoots: [srv]\n",
		"mountPolicy: {allowSuidDev: true, types: [ext4]}\n", "nbd: {allowedServers: ['10.0.0.0/8:10809'], socketRoots: [/run/nbd]}\n",
		"iscsi: {allowedPortals: ['10.0.0.1:3260']}\n", "fuseProfiles: [{name: x}]\n", "unknown: 1\n",
		fuseBase + "  env: {LD_PRELOAD: /tmp/x.so}\n", fuseBase + "  env: {HOME: /root}\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data, "fuzz")
		if err != nil {
			return
		}
		for _, r := range c.ImageRoots {
			if !plan.IsCleanAbs(r) {
				t.Fatalf("accepted image root %q", r)
			}
		}
		if err := fuseprofile.Validate(c.FuseProfiles); err != nil {
			t.Fatalf("accepted profiles that fail validation: %v", err)
		}
		for _, p := range c.FuseProfiles {
			for k := range p.Env {
				if fuseprofile.IsLoaderVar(k) || k == "PATH" {
					t.Fatalf("profile %s sets %s", p.Name, k)
				}
			}
		}
		out, err := yaml.Marshal(c)
		if err != nil {
			t.Fatalf("write out: %v", err)
		}
		again, err := Parse(out, "again")
		if err != nil {
			t.Fatalf("a config written out does not parse again: %v\n%s", err, out)
		}
		a, _ := json.Marshal(c)
		b, _ := json.Marshal(again)
		if string(a) != string(b) {
			t.Fatalf("read back differently:\n%s\n%s", a, b)
		}
	})
}
