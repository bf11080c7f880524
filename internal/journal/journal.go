// Package journal keeps the driver's crash-safe records under the state
// dir: one JSON file per record, in one generic Store per kind of record
// (OpenVolumes: <state-dir>/volumes, OpenSnapshots: <state-dir>/snapshots,
// Shared: a source's <state-dir>/shared/<kind>), and the mounter's records
// of what it set up (Records). The record types are internal/model's.
//
// The driver writes a record's intent before each side effect (a phase such
// as "staging") and its completion after it, so that after a crash the
// reconciler knows what may be half done and how to undo it.
//
// Writes come in two durabilities. A durable write (an image was created, a
// format is under way) goes through a temp file, fsync, rename and fsync of
// the directory. A runtime write (devices, mounts, consumers: state a
// reboot erases anyway) skips the fsyncs. A volume record is rewritten in
// place by a runtime write, with one write that survives a crash of the
// plugin, and its last durable write is kept twice (volumes/<id>.json and
// <id>.json.durable): if a machine crash tears the rewrite, Get falls back
// to the durable copy. The layout explains itself and reads with cat.
package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/model"
)

// ErrCorrupt is in the error of a record that does not decode: a runtime
// write (no fsync) torn by a machine crash, when no durable copy stands in.
// Such a record describes an ended boot.
var ErrCorrupt = errors.New("record is corrupt")

// Durability says what a write must survive.
type Durability int

const (
	// Runtime records describe kernel state (attached devices, mounts,
	// namespaces) that a reboot erases too. Their writes survive a crash
	// of the plugin (the page cache outlives the process) but skip fsync:
	// in a store that rewrites in place, an existing record of up to a
	// page is rewritten with one write, a new or larger one goes through
	// a temp file and a rename. After a machine crash the reconciler finds
	// the devices and mounts gone whatever the record says, and Get falls
	// back to the durable copy if the record is torn.
	Runtime Durability = iota
	// Durable records describe what is on disk (an image exists, a format
	// is under way) and survive a machine crash: fsync of the file and its
	// directory.
	Durable
)

// Store is a directory of records of type T, one JSON file per key
// (<dir>/<key>.json, the key a model.ValidID), each replaced atomically.
type Store[T any] struct {
	dir  string
	what string // what a record is, for errors: "volume", "snapshot"
	// inPlace: runtime writes rewrite a record in place, and durable
	// writes keep a copy (<key>.json.durable) that Get falls back to
	// when a machine crash tore such a rewrite.
	inPlace bool
}

// OpenVolumes prepares <state-dir>/volumes and returns the store of volume
// records over it. Runtime writes rewrite a record in place.
func OpenVolumes(stateDir string) (*Store[model.Volume], error) {
	return open[model.Volume](filepath.Join(stateDir, "volumes"), "volume", true)
}

// OpenSnapshots prepares <state-dir>/snapshots and returns the store of
// snapshot records over it. What a snapshot describes is on disk: every
// write of it is durable.
func OpenSnapshots(stateDir string) (*Store[model.Snapshot], error) {
	return open[model.Snapshot](filepath.Join(stateDir, "snapshots"), "snapshot", false)
}

// Shared returns the store of a source's records of kind about something
// several volumes use (an iSCSI session logged in once for all the LUNs of
// a target): <state-dir>/shared/<kind>/, made at its first write. They are
// written durably, since what they describe outlives the plugin (the node
// records it made, the sessions it owns). The driver owns them and their
// locks; a source reads and writes them only through the driver.
func Shared(stateDir, kind string) (*Store[json.RawMessage], error) {
	if err := model.ValidID(kind); err != nil {
		return nil, fmt.Errorf("shared record kind: %w", err)
	}
	return &Store[json.RawMessage]{dir: filepath.Join(stateDir, "shared", kind), what: kind}, nil
}

func open[T any](dir, what string, inPlace bool) (*Store[T], error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	return &Store[T]{dir: dir, what: what, inPlace: inPlace}, nil
}

func (s *Store[T]) path(key string) string { return filepath.Join(s.dir, key+".json") }

// durableCopy is where the last durable write of a record is kept as
// well: the fallback when a runtime rewrite in place was torn by a
// machine crash (see overwriteInPlace).
func (s *Store[T]) durableCopy(key string) string { return s.path(key) + ".durable" }

// Get returns the record of key, or an error wrapping errdefs.ErrNotFound.
func (s *Store[T]) Get(key string) (*T, error) {
	if err := model.ValidID(key); err != nil {
		return nil, err
	}
	v, err := readRecord[T](s.path(key))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s %s: %w", s.what, key, errdefs.ErrNotFound)
	}
	if err == nil {
		return v, nil
	}
	// A record that does not parse was being rewritten in place when the
	// machine went down. Its runtime part described devices and mounts
	// that went down with it; the durable copy holds what is on disk.
	if s.inPlace {
		if dv, derr := readRecord[T](s.durableCopy(key)); derr == nil {
			return dv, nil
		}
	}
	return nil, fmt.Errorf("journal: %s record %s: %w", s.what, key, err)
}

func readRecord[T any](path string) (*T, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	v := new(T)
	if err := json.Unmarshal(b, v); err != nil {
		return nil, fmt.Errorf("%s is corrupt: %w: %w", filepath.Base(path), ErrCorrupt, err)
	}
	return v, nil
}

// Put writes v as key's record atomically: after a crash the file holds
// either the old or the new record, never a mix. d says whether it must
// survive a machine crash. It returns the record as written (v in JSON),
// for a caller that keeps it: one encoding serves both. A store whose
// directory is not made yet (a shared kind's first record) makes it.
func (s *Store[T]) Put(key string, v *T, d Durability) ([]byte, error) {
	if err := model.ValidID(key); err != nil {
		return nil, err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	err = s.write(key, b, d)
	if errors.Is(err, fs.ErrNotExist) {
		if err = os.MkdirAll(s.dir, 0o700); err == nil {
			err = s.write(key, b, d)
		}
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (s *Store[T]) write(key string, b []byte, d Durability) error {
	if d == Durable {
		if err := writeRecord(s.path(key), b, true); err != nil || !s.inPlace {
			return err
		}
		return writeRecord(s.durableCopy(key), b, true)
	}
	if s.inPlace {
		if done, err := overwriteInPlace(s.path(key), b); done || err != nil {
			return err
		}
	}
	return writeRecord(s.path(key), b, false)
}

// pageSize bounds what one write(2) puts into the page cache in one piece:
// the kernel copies a write page by page and a fatal signal can stop it
// only between pages.
const pageSize = 4096

// overwriteInPlace rewrites an existing record with a single pwrite at
// offset 0, padded with spaces (which JSON ignores) to the old length so
// no truncate is needed. That is as atomic against a crash of the process
// as a rename, for records within one page, and several times cheaper on
// ext4, whose rename-over-an-existing-file forces out the new file's data.
// It reports false, and writes nothing, when the record is new or too big.
func overwriteInPlace(path string, data []byte) (bool, error) {
	// Raw calls, not os.OpenFile: the record is written on every change of
	// a volume, and os wraps a regular file in the poller (three fcntl, an
	// epoll_ctl that fails, an fstat), which is most of a write's cost.
	fd, err := ignoringEINTR(func() (int, error) { return unix.Open(path, unix.O_WRONLY|unix.O_CLOEXEC, 0) })
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("journal: open %s: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, fmt.Errorf("journal: fstat %s: %w", path, err)
	}
	size := max(int64(len(data)), st.Size)
	if size > pageSize {
		return false, nil
	}
	buf := make([]byte, size)
	n := copy(buf, data)
	for i := n; i < len(buf); i++ {
		buf[i] = ' '
	}
	// One pwrite on a local filesystem; a short one (a filesystem that
	// splits writes, a signal) is carried on, as os.File.WriteAt did.
	for off := 0; off < len(buf); {
		n, err := ignoringEINTR(func() (int, error) { return unix.Pwrite(fd, buf[off:], int64(off)) })
		if err == nil && n == 0 {
			err = io.ErrShortWrite
		}
		if err != nil {
			return false, fmt.Errorf("journal: write %s: %w", path, err)
		}
		off += n
	}
	return true, nil
}

// ignoringEINTR calls fn again while it fails with EINTR.
func ignoringEINTR(fn func() (int, error)) (int, error) {
	for {
		n, err := fn()
		if !errors.Is(err, unix.EINTR) {
			return n, err
		}
	}
}

// Delete removes the record of key; a missing record is not an error.
func (s *Store[T]) Delete(key string, d Durability) error {
	if err := model.ValidID(key); err != nil {
		return err
	}
	// The record first, so that a crash in between leaves no record
	// whose only trace is an old durable copy.
	paths := []string{s.path(key)}
	if s.inPlace {
		paths = append(paths, s.durableCopy(key))
	}
	for _, p := range paths {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("journal: %w", err)
		}
	}
	if d != Durable {
		return nil
	}
	if err := fsutil.SyncDir(s.dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("journal: fsync %s: %w", s.dir, err)
	}
	return nil
}

// Keys lists the keys of the records, sorted. A directory not made yet
// holds none.
func (s *Store[T]) Keys() ([]string, error) {
	entries, err := os.ReadDir(s.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	var keys []string
	for _, e := range entries {
		if key, ok := strings.CutSuffix(e.Name(), ".json"); ok && e.Type().IsRegular() && model.ValidID(key) == nil {
			keys = append(keys, key)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// List returns every record, sorted by key. Records that do not read are
// returned in the error, not silently skipped.
func (s *Store[T]) List() ([]*T, error) {
	var out []*T
	err := s.each(func(_ string, v *T) { out = append(out, v) })
	return out, err
}

// each calls fn with every record that reads, in the order of their keys,
// and returns the errors of those that do not.
func (s *Store[T]) each(fn func(key string, v *T)) error {
	keys, err := s.Keys()
	if err != nil {
		return err
	}
	var errs []error
	for _, key := range keys {
		v, err := s.Get(key)
		switch {
		case errors.Is(err, errdefs.ErrNotFound): // deleted since the listing
		case err != nil:
			errs = append(errs, err)
		default:
			fn(key, v)
		}
	}
	return errors.Join(errs...)
}

// ReadAll returns the bytes of every record by key, for a caller that
// decodes each once, later (the driver at start: 10,000 records decoded
// twice were most of a restart's CPU). A record is checked with
// json.Valid, which allocates nothing; one that is not valid JSON (torn by
// a machine crash during a rewrite in place) is replaced by its durable
// copy as Get would, and one without a valid copy is returned in the error.
func (s *Store[T]) ReadAll() (map[string][]byte, error) {
	keys, err := s.Keys()
	if err != nil {
		return nil, err
	}
	out := make(map[string][]byte, len(keys))
	var errs []error
	for _, key := range keys {
		b, err := os.ReadFile(s.path(key))
		if err == nil && !json.Valid(b) {
			b, err = nil, fmt.Errorf("journal: %s record %s: %s is corrupt", s.what, key, filepath.Base(s.path(key)))
			if s.inPlace {
				if db, derr := os.ReadFile(s.durableCopy(key)); derr == nil && json.Valid(db) {
					b, err = db, nil
				}
			}
		}
		switch {
		case errors.Is(err, fs.ErrNotExist): // deleted since the listing
		case err != nil:
			errs = append(errs, err)
		default:
			out[key] = b
		}
	}
	return out, errors.Join(errs...)
}

// CheckWritable proves the store can still be written and synced (for
// Probe). It writes .probe in place: what it holds does not matter, and a
// temp file would be left behind by a crash during a Probe.
func (s *Store[T]) CheckWritable() (err error) {
	f, err := os.OpenFile(filepath.Join(s.dir, ".probe"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("journal: %w", cerr)
		}
	}()
	if _, err := f.WriteString("ok\n"); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("journal: fsync: %w", err)
	}
	return nil
}

// TempFiles lists, by key, the temp files of record writes that a crash
// interrupted (of a record and of its durable copy). Only a caller that
// holds the record's lock, so that no write of it is under way, may remove
// them.
func (s *Store[T]) TempFiles() (map[string][]string, error) {
	temps, err := fsutil.AtomicTemps(s.dir)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	out := map[string][]string{}
	for name, paths := range temps {
		key, ok := strings.CutSuffix(strings.TrimSuffix(name, ".durable"), ".json")
		if ok && model.ValidID(key) == nil {
			out[key] = append(out[key], paths...)
		}
	}
	return out, nil
}

// writeRecord writes data to path through a temp file and a rename
// (fsutil.WriteFileAtomic). When durable, the temp file is synced before
// the rename and the directory after it, so the rename itself survives a
// machine crash.
func writeRecord(path string, data []byte, durable bool) error {
	if err := fsutil.WriteFileAtomic(path, data, 0o600, durable); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	return nil
}
