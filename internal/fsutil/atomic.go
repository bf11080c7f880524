package fsutil

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// WriteFileAtomic replaces path with data through a temp file of mode perm
// in the same directory (see CreateAtomic): readers see the old or the new
// content, never a part of it.
func WriteFileAtomic(path string, data []byte, perm fs.FileMode, durable bool) error {
	return CreateAtomic(path, perm, durable, func(f *os.File) error {
		_, err := f.Write(data)
		return err
	})
}

// CreateAtomic makes path through a temp file: it creates
// ".<name>.tmp-*" next to path with mode perm (the temp file is never
// readable by others, even for a moment), lets fill write it, and renames
// it over path. When durable, the file is synced before the rename and the
// directory after it, so the new file survives a machine crash; otherwise
// it survives a crash of the process only. On error the temp file is
// removed and path is left as it was.
func CreateAtomic(path string, perm fs.FileMode, durable bool, fill func(f *os.File) error) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+tempInfix+"*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	if err = f.Chmod(perm); err != nil {
		return err
	}
	if err = fill(f); err != nil {
		return err
	}
	if durable {
		if err = f.Sync(); err != nil {
			return err
		}
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(f.Name(), path); err != nil {
		return err
	}
	if !durable {
		return nil
	}
	return SyncDir(dir)
}

// tempInfix sits between the name of the file CreateAtomic makes and the
// random digits of its temp file: ".<name>.tmp-<digits>".
const tempInfix = ".tmp-"

// AtomicTemps lists the temp files CreateAtomic left in dir because its
// process died before the rename, by the name of the file each was to
// become. Only a caller that knows no CreateAtomic of that name is under
// way may remove them. A missing dir has none.
func AtomicTemps(dir string) (map[string][]string, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, e := range ents {
		name := e.Name()
		i := strings.LastIndex(name, tempInfix)
		if e.IsDir() || i < 2 || name[0] != '.' {
			continue // not a temp file (a name shorter than the infix too)
		}
		if digits := name[i+len(tempInfix):]; digits == "" || strings.Trim(digits, "0123456789") != "" {
			continue
		}
		out[name[1:i]] = append(out[name[1:i]], filepath.Join(dir, name))
	}
	return out, nil
}

// SyncDir fsyncs a directory, which makes the creations, renames and
// removals in it survive a machine crash.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
