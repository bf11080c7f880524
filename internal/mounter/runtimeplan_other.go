//go:build !linux

package mounter

import (
	"context"

	"github.com/mountplan/mountplan/pkg/plan"
)

// CheckPlan is implemented on Linux only: elsewhere every plan is refused.
func (n *Local) CheckPlan(context.Context, []plan.Mount) error { return errNotLinux }
