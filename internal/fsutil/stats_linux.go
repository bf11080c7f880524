package fsutil

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Stats returns the usage of the filesystem that holds path (statfs(2)).
// Used bytes count blocks not free, including those reserved for root, so
// Used + Available can be less than Total, as df shows it.
func Stats(path string) (Usage, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return Usage{}, fmt.Errorf("fsutil: statfs %s: %w: %w", path, errdefs.ErrNotFound, err)
		}
		return Usage{}, fmt.Errorf("fsutil: statfs %s: %w", path, err)
	}
	// Block counts are in f_frsize units; f_bsize is only the preferred
	// I/O size, which differs on some filesystems.
	bs := st.Frsize
	if bs == 0 {
		bs = st.Bsize
	}
	return Usage{
		TotalBytes:     int64(st.Blocks) * bs,
		AvailableBytes: int64(st.Bavail) * bs,
		UsedBytes:      int64(st.Blocks-st.Bfree) * bs,
		TotalInodes:    int64(st.Files),
		FreeInodes:     int64(st.Ffree),
		UsedInodes:     int64(st.Files - st.Ffree),
	}, nil
}
