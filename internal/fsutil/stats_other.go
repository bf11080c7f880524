//go:build !linux

package fsutil

import (
	"fmt"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Stats needs Linux's statfs; the plugin runs nowhere else.
func Stats(path string) (Usage, error) {
	return Usage{}, fmt.Errorf("fsutil: statfs %s: %w", path, errdefs.ErrUnimplemented)
}
