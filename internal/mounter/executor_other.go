//go:build !linux

package mounter

import (
	"context"
	"fmt"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

var errNotLinux = fmt.Errorf("mount namespaces need Linux: %w", errdefs.ErrUnimplemented)

// Mount is implemented on Linux only.
func (e *Executor) Mount(context.Context, []plan.Mount, plan.Consumer) error { return errNotLinux }

// Unmount is implemented on Linux only.
func (e *Executor) Unmount(context.Context, []plan.Mount, plan.Consumer) error { return errNotLinux }

// UnmountAll is implemented on Linux only.
func (e *Executor) UnmountAll(context.Context, plan.Consumer) error { return errNotLinux }

// HealFuse is implemented on Linux only.
func (e *Executor) HealFuse(context.Context, plan.Heal) (plan.HealResult, error) {
	return plan.HealResult{}, errNotLinux
}
