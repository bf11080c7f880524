package blocking

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Stat is unix.Stat of path (symlinks followed) by ctx's end, shared with
// the callers that stat path meanwhile (Shared). A filesystem that has not
// answered by then makes it errdefs.ErrUnavailable (and ctx's error); a
// failed stat is an *os.PathError.
func Stat(ctx context.Context, path string) (unix.Stat_t, error) {
	st, err := Shared(ctx, "stat\x00"+path, "stat "+path, func() (unix.Stat_t, error) {
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			return st, &os.PathError{Op: "stat", Path: path, Err: err}
		}
		return st, nil
	})
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return st, fmt.Errorf("%w: %w", err, errdefs.ErrUnavailable)
	}
	return st, err
}
