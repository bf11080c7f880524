package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/mountplan/mountplan/internal/fsutil"
)

// Records is a directory of records of one type, one JSON file per key
// (<dir>/<key>.json), each replaced atomically. It is for small sets of
// records that are read whole at start and kept in memory by their owner
// (the mounter's records of what it set up).
type Records[T any] struct {
	dir     string
	durable bool
}

// OpenRecords makes dir (mode 0700) and returns the records in it. With
// durable, every write survives a machine crash (fsync of the file and the
// directory); without, a crash of the process only: records of what a
// reboot undoes anyway need no fsync.
func OpenRecords[T any](dir string, durable bool) (*Records[T], error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("records: %w", err)
	}
	return &Records[T]{dir: dir, durable: durable}, nil
}

func (r *Records[T]) path(key string) (string, error) {
	if err := ValidID(key); err != nil {
		return "", fmt.Errorf("record key: %w", err)
	}
	return filepath.Join(r.dir, key+".json"), nil
}

// Put writes v under key.
func (r *Records[T]) Put(key string, v T) error {
	p, err := r.path(key)
	if err != nil {
		return err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := fsutil.WriteFileAtomic(p, b, 0o600, r.durable); err != nil {
		return fmt.Errorf("records: %w", err)
	}
	return nil
}

// Delete removes key's record; none is no error.
func (r *Records[T]) Delete(key string) error {
	p, err := r.path(key)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("records: %w", err)
	}
	if r.durable {
		return fsutil.SyncDir(r.dir)
	}
	return nil
}

// List reads every record by key. A file that does not decode is an
// error naming it (its owner decides whether to go on without it); temp
// files of interrupted writes are removed.
func (r *Records[T]) List() (map[string]T, error) {
	ents, err := os.ReadDir(r.dir)
	if err != nil {
		return nil, fmt.Errorf("records: %w", err)
	}
	out := map[string]T{}
	var errs []error
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-") {
			errs = append(errs, os.Remove(filepath.Join(r.dir, name)))
			continue
		}
		key, ok := strings.CutSuffix(name, ".json")
		if !ok || !e.Type().IsRegular() || ValidID(key) != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(r.dir, name))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var v T
		if err := json.Unmarshal(b, &v); err != nil {
			errs = append(errs, fmt.Errorf("records: %s: %w", filepath.Join(r.dir, name), err))
			continue
		}
		out[key] = v
	}
	return out, errors.Join(errs...)
}
