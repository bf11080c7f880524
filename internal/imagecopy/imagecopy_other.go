//go:build !linux

package imagecopy

import (
	"context"
	"fmt"
	"os"

	"github.com/mountplan/mountplan/internal/errdefs"
)

var errNoCopy = fmt.Errorf("imagecopy: copies need Linux: %w", errdefs.ErrUnimplemented)

func copyInto(context.Context, *os.File, *os.File, int64) (Method, error) { return "", errNoCopy }
