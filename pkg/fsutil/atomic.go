package fsutil

import (
	"io/fs"
	"os"
	"path/filepath"
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
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
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
