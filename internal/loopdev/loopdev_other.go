//go:build !linux

package loopdev

import (
	"context"
	"fmt"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Loop devices exist only on Linux; these keep importers building elsewhere.

var errNoLoop = fmt.Errorf("loopdev: loop devices need Linux: %w", errdefs.ErrUnimplemented)

func Attach(context.Context, string, Options) (*Device, error) { return nil, errNoLoop }
func Adopt(string, Identity) (*Device, error)                  { return nil, errNoLoop }
func FindByBacking(string) ([]*Device, error)                  { return nil, errNoLoop }
func (d *Device) Detach() error                                { return errNoLoop }
func (d *Device) Close() error                                 { return nil }
func (d *Device) SetCapacity() error                           { return errNoLoop }
func (d *Device) Size() (int64, error)                         { return 0, errNoLoop }

var ErrOpenElsewhere = fmt.Errorf("file is open elsewhere")

func WhileUnopened(string, func() error) error { return errNoLoop }
