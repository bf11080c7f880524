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
	return RemoveCgroupTreeExcept(name, nil)
}

// CgroupTree lists the cgroup directory name and the directories below it
// in every mounted hierarchy (v1 and v2 of a hybrid host alike).
func CgroupTree(name string) (map[string]bool, error) {
	tops, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	dirs := map[string]bool{}
	for _, top := range tops {
		for _, d := range walkDirs(filepath.Join(top, name)) {
			dirs[d] = true
		}
	}
	return dirs, nil
}

// RemoveCgroupTreeExcept is RemoveCgroupTree sparing the directories in
// keep (CgroupTree's answer before a test started: what the test found
// there is not its own; a kept directory's parent is kept too).
func RemoveCgroupTreeExcept(name string, keep map[string]bool) error {
	tops, err := cgroupMounts()
	if err != nil {
		return err
	}
	var errs []error
	for _, top := range tops {
		dirs := walkDirs(filepath.Join(top, name))
		for i := len(dirs) - 1; i >= 0; i-- {
			if keep[dirs[i]] {
				continue
			}
			if err := unix.Rmdir(dirs[i]); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// CgroupNames lists the names of the cgroup directories at the top of any
// mounted hierarchy that match pattern (filepath.Match), each once.
func CgroupNames(pattern string) ([]string, error) {
	tops, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var names []string
	for _, top := range tops {
		matches, err := filepath.Glob(filepath.Join(top, pattern))
		if err != nil {
			return nil, err
		}
		for _, m := range matches {
			if name := filepath.Base(m); !seen[name] {
				seen[name] = true
				names = append(names, name)
			}
		}
	}
	return names, nil
}

// cgroupMounts lists the mount points of every cgroup hierarchy.
func cgroupMounts() ([]string, error) { return mountsOfType("cgroup", "cgroup2") }

// Cgroup2Root is where the v2 hierarchy is mounted: /sys/fs/cgroup on a
// v2 host, /sys/fs/cgroup/unified on a hybrid one (systemd's layout).
func Cgroup2Root() (string, error) {
	tops, err := mountsOfType("cgroup2")
	if err != nil {
		return "", err
	}
	if len(tops) == 0 {
		return "", errors.New("no cgroup2 hierarchy mounted")
	}
	return tops[0], nil
}

func mountsOfType(types ...string) ([]string, error) {
	infos, err := mountinfo.GetMounts(mountinfo.FSTypeFilter(types...))
	if err != nil {
		return nil, err
	}
	tops := make([]string, 0, len(infos))
	for _, mi := range infos {
		tops = append(tops, mi.Mountpoint)
	}
	return tops, nil
}

// walkDirs lists top and the directories below it, parents first.
func walkDirs(top string) []string {
	var dirs []string
	_ = filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	return dirs
}
