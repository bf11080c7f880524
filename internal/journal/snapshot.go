package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
)

// Snapshot is the record of one snapshot: a point-in-time copy of a
// provisioned volume's image under <state-dir>/images/snapshots/. What it
// describes is on disk, so every write of it is durable.
type Snapshot struct {
	ID string `json:"id"`
	// SourceVolume is the volume the image was copied from. The snapshot
	// does not depend on it afterwards: deleting the volume keeps it.
	SourceVolume string `json:"sourceVolume"`
	Image        string `json:"image"`
	// SizeBytes is the size of the image, the source's capacity: a volume
	// restored from it is at least that big.
	SizeBytes int64 `json:"sizeBytes"`
	// FsType and Format are the source's at the time of the copy.
	FsType  string    `json:"fsType,omitempty"`
	Format  *Format   `json:"format,omitempty"`
	Created time.Time `json:"created"`
	// Method is how the image was copied ("reflink" or "copy").
	Method string `json:"method,omitempty"`
	// Creating is set before the copy starts and cleared after the image
	// is complete; a record found Creating under its lock was interrupted.
	Creating bool `json:"creating,omitempty"`
	// Frozen: the source's filesystem is (or may be) frozen for the copy
	// (see ContentSource.Frozen).
	Frozen bool `json:"frozen,omitempty"`
}

// Snapshots reads and writes snapshot records in <state-dir>/snapshots/.
type Snapshots struct {
	dir string
}

// OpenSnapshots prepares <state-dir>/snapshots and returns a store over it.
func OpenSnapshots(stateDir string) (*Snapshots, error) {
	dir := filepath.Join(stateDir, "snapshots")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	return &Snapshots{dir: dir}, nil
}

func (s *Snapshots) path(id string) string { return filepath.Join(s.dir, id+".json") }

// Get returns the record of id, or an error wrapping errdefs.ErrNotFound.
func (s *Snapshots) Get(id string) (*Snapshot, error) {
	if err := ValidID(id); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(s.path(id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	snap := &Snapshot{}
	if err := json.Unmarshal(b, snap); err != nil {
		return nil, fmt.Errorf("journal: snapshot record %s is corrupt: %w", id, err)
	}
	return snap, nil
}

// Put writes the record durably (temp file, fsync, rename, fsync of the
// directory).
func (s *Snapshots) Put(snap *Snapshot) error {
	if err := ValidID(snap.ID); err != nil {
		return err
	}
	b, err := json.Marshal(snap)
	if err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	return writeRecord(s.path(snap.ID), b, true)
}

// Delete removes the record of id durably; a missing one is not an error.
func (s *Snapshots) Delete(id string) error {
	if err := ValidID(id); err != nil {
		return err
	}
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("journal: %w", err)
	}
	return syncDir(s.dir)
}

// List returns every record, sorted by ID; records that do not read are
// returned in the error.
func (s *Snapshots) List() ([]*Snapshot, error) {
	ids, err := recordIDs(s.dir)
	if err != nil {
		return nil, err
	}
	var out []*Snapshot
	var errs []error
	for _, id := range ids {
		snap, err := s.Get(id)
		switch {
		case errors.Is(err, errdefs.ErrNotFound): // deleted meanwhile
		case err != nil:
			errs = append(errs, err)
		default:
			out = append(out, snap)
		}
	}
	slices.SortFunc(out, func(a, b *Snapshot) int { return strings.Compare(a.ID, b.ID) })
	return out, errors.Join(errs...)
}

// TempFiles lists, by snapshot ID, the temp files of record writes that a
// crash interrupted. Only a holder of the snapshot's lock may remove them.
func (s *Snapshots) TempFiles() (map[string][]string, error) {
	temps, err := fsutil.AtomicTemps(s.dir)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	out := map[string][]string{}
	for name, paths := range temps {
		if id, ok := strings.CutSuffix(name, ".json"); ok && ValidID(id) == nil {
			out[id] = append(out[id], paths...)
		}
	}
	return out, nil
}
