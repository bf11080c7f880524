//go:build !linux

package nbdnl

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// NBD devices exist only on Linux; these keep importers building elsewhere.

var errNoNBD = fmt.Errorf("nbdnl: NBD devices need Linux: %w", errdefs.ErrUnimplemented)

func Connect(Config, []*os.File) (int, error)          { return -1, errNoNBD }
func Reconfigure(int, []*os.File, time.Duration) error { return errNoNBD }
func ReconfigureBackend(int, string, []*os.File, time.Duration) error {
	return errNoNBD
}
func Backend(int) string                       { return "" }
func FindBackend(string) int                   { return -1 }
func DeviceNumber(int) (uint32, uint32, error) { return 0, 0, errNoNBD }
func Disconnect(int) error                     { return errNoNBD }
func Status(int) (bool, error)                 { return false, errNoNBD }

type Watcher struct{}

func WatchLinkDead() (*Watcher, error)               { return nil, errNoNBD }
func (w *Watcher) Next(context.Context) (int, error) { return -1, errNoNBD }
func (w *Watcher) Close() error                      { return nil }
