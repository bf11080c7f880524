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

func executor(roots ...string) *mounter.Executor {
	return &mounter.Executor{Policy: plan.Policy{Roots: roots}}
}
