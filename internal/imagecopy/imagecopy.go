// Package imagecopy copies volume images: by reflink (FICLONE) where the
// filesystem under the state dir shares extents between files (xfs,
// btrfs), else by a sparse copy that reads and writes only the data
// extents (SEEK_DATA/SEEK_HOLE and copy_file_range), so a 1 GiB image
// holding 100 MiB costs 100 MiB of I/O and of space, not 1 GiB.
//
// A copy is made under a temp name next to its destination and renamed
// into place once complete and synced (fsutil.CreateAtomic): a crash
// leaves the destination absent, never half written; the temp file is
// found by fsutil.AtomicTemps.
package imagecopy

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mountplan/mountplan/internal/fsutil"
)

// Method says how a copy was made.
type Method string

const (
	// Reflink: the copy shares the source's extents (FICLONE); it took no
	// data I/O and no space until either file is written.
	Reflink Method = "reflink"
	// Sparse: the data extents were copied with copy_file_range; holes
	// stay holes. (The kernel may still share extents where it can: a
	// copy_file_range within one xfs or btrfs remaps instead of copying,
	// but FICLONE is tried first there anyway.)
	Sparse Method = "copy"
)

// Options tune a copy.
type Options struct {
	// Size is the size the copy gets; 0 keeps the source's. A larger
	// size extends the copy with a hole (a clone asked to be bigger).
	Size int64
}

// File copies the regular file src to dst, which must not exist yet
// (an existing dst is an error: the caller decides what a leftover is).
// The copy is synced, and so is its directory, before File returns.
func File(ctx context.Context, src, dst string, opts Options) (Method, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("copy %s: not a regular file", src)
	}
	if _, err := os.Lstat(dst); err == nil {
		return "", fmt.Errorf("copy %s to %s: %w", src, dst, os.ErrExist)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return "", err
	}
	size := max(opts.Size, fi.Size())
	var method Method
	err = fsutil.CreateAtomic(dst, 0o600, true, func(out *os.File) error {
		var err error
		method, err = copyInto(ctx, in, out, fi.Size())
		if err != nil {
			return fmt.Errorf("copy %s to %s: %w", src, dst, err)
		}
		if size > fi.Size() {
			return out.Truncate(size)
		}
		return nil
	})
	return method, err
}
