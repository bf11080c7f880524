package mounter_test

import (
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

var safe = []string{"nosuid", "nodev"}

func opts(extra ...string) []string { return append(append([]string{}, safe...), extra...) }

func tmpfs(label, target string, extra ...string) plan.Mount {
	return plan.Mount{Type: "tmpfs", Source: label, Target: target, Options: opts(extra...)}
}

// executor allows host paths and loop devices' images under roots, and
// consumers in its own namespace (as kubelet's publishes) below the first
// root.
func executor(roots ...string) *mounter.Executor {
	e := &mounter.Executor{Policy: plan.Policy{Roots: roots, ImageRoots: roots}}
	if len(roots) > 0 {
		e.KubeletDir = roots[0]
	}
	return e
}
