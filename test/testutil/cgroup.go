package testutil

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// RemoveCgroupTree removes the (empty) cgroup directory name and the
// directories below it, deepest first, in every mounted hierarchy.
func RemoveCgroupTree(name string) error {
	infos, err := mountinfo.GetMounts(func(mi *mountinfo.Info) (skip, stop bool) {
		return mi.FSType != "cgroup" && mi.FSType != "cgroup2", false
	})
	if err != nil {
		return err
	}
	var errs []error
	for _, mi := range infos {
		top := filepath.Join(mi.Mountpoint, name)
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := unix.Rmdir(dirs[i]); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}
