package imagecopy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// chunk bounds one copy_file_range call, so that a cancelled context
// stops a long copy within one chunk's I/O.
const chunk = 64 << 20

// copyInto fills out (empty) with the first size bytes of in.
func copyInto(ctx context.Context, in, out *os.File, size int64) (Method, error) {
	err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
	if err == nil {
		return Reflink, nil
	}
	if !reflinkUnsupported(err) {
		return "", fmt.Errorf("FICLONE: %w", err)
	}
	if err := sparseCopy(ctx, in, out, size); err != nil {
		return "", err
	}
	return Sparse, nil
}

// reflinkUnsupported: the filesystem cannot share extents (ext4, tmpfs:
// EOPNOTSUPP or ENOTTY), or not between these two files (EXDEV: two
// filesystems; EINVAL: an unaligned size, which image sizes never are but
// a copy falls back all the same).
func reflinkUnsupported(err error) bool {
	for _, e := range []error{unix.EOPNOTSUPP, unix.ENOTTY, unix.EXDEV, unix.EINVAL, unix.ENOSYS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// sparseCopy copies each data extent of in to the same offset of out and
// sizes out to size, leaving the holes unallocated.
func sparseCopy(ctx context.Context, in, out *os.File, size int64) error {
	if err := out.Truncate(size); err != nil {
		return err
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("SEEK_DATA at %d: %w", off, err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("SEEK_HOLE at %d: %w", data, err)
		}
		hole = min(hole, size)
		if err := copyRange(ctx, in, out, data, hole); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies [from, to) of in to the same range of out.
func copyRange(ctx context.Context, in, out *os.File, from, to int64) error {
	for from < to {
		if err := ctx.Err(); err != nil {
			return err
		}
		roff, woff := from, from
		n, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(to-from, chunk)), 0)
		if err != nil {
			return fmt.Errorf("copy_file_range at %d: %w", from, err)
		}
		if n == 0 {
			return fmt.Errorf("copy_file_range at %d: %w", from, io.ErrUnexpectedEOF)
		}
		from += int64(n)
	}
	return nil
}
