package journal

import (
	"errors"
	"os"
	"path/filepath"
)

// Records is a Store for an owner that reads its records whole at start
// and keeps them in memory (the mounter's records of what it set up): one
// durability for every write, and List returns every record by key.
type Records[T any] struct {
	store *Store[T]
	d     Durability
}

// OpenRecords makes dir (mode 0700) and returns the records in it. With
// durable, every write survives a machine crash (fsync of the file and the
// directory); without, a crash of the process only: records of what a
// reboot undoes anyway need no fsync.
func OpenRecords[T any](dir string, durable bool) (*Records[T], error) {
	s, err := open[T](dir, filepath.Base(dir), false)
	if err != nil {
		return nil, err
	}
	r := &Records[T]{store: s}
	if durable {
		r.d = Durable
	}
	return r, nil
}

// Put writes v under key.
func (r *Records[T]) Put(key string, v T) error {
	_, err := r.store.Put(key, &v, r.d)
	return err
}

// Get reads key's record from disk, for an owner whose records another
// process may add to (an admin's one-shot command beside the mounter); an
// error wraps errdefs.ErrNotFound when there is none.
func (r *Records[T]) Get(key string) (T, error) {
	v, err := r.store.Get(key)
	if err != nil {
		var zero T
		return zero, err
	}
	return *v, nil
}

// Keys lists the records' keys, reading none of them.
func (r *Records[T]) Keys() ([]string, error) { return r.store.Keys() }

// Delete removes key's record; none is no error.
func (r *Records[T]) Delete(key string) error { return r.store.Delete(key, r.d) }

// List reads every record by key. A file that does not decode is an
// error naming it (its owner decides whether to go on without it). The
// temp files of writes a crash interrupted are removed: the owner lists
// its records before it writes any.
func (r *Records[T]) List() (map[string]T, error) {
	temps, err := r.store.TempFiles()
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, paths := range temps {
		for _, p := range paths {
			errs = append(errs, os.Remove(p))
		}
	}
	out := map[string]T{}
	err = r.store.each(func(key string, v *T) { out[key] = *v })
	return out, errors.Join(append(errs, err)...)
}
