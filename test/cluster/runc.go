//go:build clustertest

package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/moby/sys/capability"
)

// runcMain is the OCI runtime of CRI-O's node: hack/tools/build.sh's runc
// (runcBeside, >= 1.2 for pods with a user namespace), after fitting
// a container's spec (config.json in its bundle) to this machine, as
// containerd's configuration does on the other nodes:
//   - a negative oom_score_adj (kubelet asks -997 for the chart's
//     system-node-critical pods) is raised to 0: setting one needs
//     CAP_SYS_RESOURCE, which this machine's root lacks (containerd's
//     restrict_oom_score_adj; CRI-O has no such setting);
//   - hugepage limits are dropped: the hugetlb controller is not mounted
//     here, and runc fails a container whose spec limits it (containerd
//     sets none when the controller is missing; CRI-O sets them anyway);
//   - capabilities outside this process's bounding set are dropped: a
//     privileged container gets every capability CRI-O knows, and runc
//     cannot give one this machine's root lacks (CAP_SYS_RESOURCE);
//     containerd gives a privileged container its own bounding set.
func runcMain() int {
	args := os.Args[1:]
	for i, a := range args {
		if (a == "--bundle" || a == "-b") && i+1 < len(args) {
			if err := fitSpec(filepath.Join(args[i+1], "config.json")); err != nil {
				fmt.Fprintln(os.Stderr, "runc-oom:", err)
				return 1
			}
		}
	}
	err := syscall.Exec(filepath.Join(filepath.Dir(os.Args[0]), runcBeside), append([]string{"runc"}, args...), os.Environ())
	fmt.Fprintln(os.Stderr, "runc-oom: exec runc:", err)
	return 1
}

// fitSpec edits an OCI spec in place; numbers and unknown fields are kept
// as they are.
func fitSpec(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var spec map[string]any
	if err := dec.Decode(&spec); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if p, ok := spec["process"].(map[string]any); ok {
		if n, ok := p["oomScoreAdj"].(json.Number); ok {
			if v, err := n.Int64(); err == nil && v < 0 {
				p["oomScoreAdj"] = 0
			}
		}
	}
	if p, ok := spec["process"].(map[string]any); ok {
		if caps, ok := p["capabilities"].(map[string]any); ok {
			held, err := boundingSet()
			if err != nil {
				return err
			}
			for kind, list := range caps {
				names, _ := list.([]any)
				kept := []any{}
				for _, n := range names {
					if name, _ := n.(string); held[name] || !known[name] {
						kept = append(kept, n)
					}
				}
				caps[kind] = kept
			}
		}
	}
	if l, ok := spec["linux"].(map[string]any); ok {
		if r, ok := l["resources"].(map[string]any); ok {
			delete(r, "hugepageLimits")
		}
	}
	out, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o600)
}

// known are the capabilities the capability library knows, by their name
// in an OCI spec; boundingSet those of them this process may give.
var known = func() map[string]bool {
	m := map[string]bool{}
	for _, c := range capability.ListKnown() {
		m[capName(c)] = true
	}
	return m
}()

func boundingSet() (map[string]bool, error) {
	caps, err := capability.NewPid2(0)
	if err != nil {
		return nil, err
	}
	if err := caps.Load(); err != nil {
		return nil, err
	}
	held := map[string]bool{}
	for _, c := range capability.ListKnown() {
		if caps.Get(capability.BOUNDING, c) {
			held[capName(c)] = true
		}
	}
	return held, nil
}

func capName(c capability.Cap) string { return "CAP_" + strings.ToUpper(c.String()) }
