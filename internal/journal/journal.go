// Package journal keeps one crash-safe record per volume under the state dir.
//
// The driver writes a record's intent before each side effect (a phase such
// as "staging") and its completion after it, so that after a crash the
// reconciler knows what may be half done and how to undo it.
//
// Writes come in two durabilities. A durable write (an image was created, a
// format is under way) goes through a temp file, fsync, rename and fsync of
// the directory, and is kept twice: volumes/<id>.json and <id>.json.durable.
// A runtime write (devices, mounts, consumers: state a reboot erases anyway)
// rewrites <id>.json in place with one write and no fsync, which survives a
// crash of the plugin; if a machine crash tears it, Get falls back to the
// durable copy. The layout explains itself and reads with cat.
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
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Kind says where a volume came from, which decides who owns its image.
type Kind string

const (
	KindProvisioned Kind = "provisioned" // CreateVolume made its image: DeleteVolume removes it
	KindStatic      Kind = "static"      // an admin's image under an allowed root: never removed
	KindEphemeral   Kind = "ephemeral"   // inline volume: image made at publish, removed at unpublish
)

// Phase is where a volume's stage stands. An intent phase found at start-up
// means the plugin died in the middle of that step.
type Phase string

const (
	PhaseStaging   Phase = "staging"
	PhaseStaged    Phase = "staged"
	PhaseUnstaging Phase = "unstaging"
)

// Volume is the record of one volume.
type Volume struct {
	ID            string            `json:"id"`
	Kind          Kind              `json:"kind"`
	Type          string            `json:"type"`
	Image         string            `json:"image,omitempty"`
	CapacityBytes int64             `json:"capacityBytes,omitempty"`
	FsType        string            `json:"fsType,omitempty"`
	Parameters    map[string]string `json:"parameters,omitempty"`
	// Creating is set before CreateVolume makes the image and cleared after.
	Creating bool `json:"creating,omitempty"`
	// Format tracks mkfs: Pending before it runs, Done after. A pending
	// format found later was interrupted and is redone from scratch, so an
	// image is never left with a half-written filesystem that never mounts.
	Format    *Format   `json:"format,omitempty"`
	Stage     *Stage    `json:"stage,omitempty"`
	Publishes []Publish `json:"publishes,omitempty"`
	Consumers []Claim   `json:"consumers,omitempty"`
	// ContentSource is what the image was copied from (a snapshot, or
	// another volume for a clone); nil for a blank volume.
	ContentSource *ContentSource `json:"contentSource,omitempty"`
	// GrowFilesystem says the image was made bigger than the filesystem
	// copied into it: the first stage with mount access grows it.
	GrowFilesystem bool `json:"growFilesystem,omitempty"`
}

// ContentSource names what an image is a copy of. Exactly one of
// Snapshot and Volume is set.
type ContentSource struct {
	Snapshot string `json:"snapshot,omitempty"`
	Volume   string `json:"volume,omitempty"`
	// Frozen is written, durably, before the source volume's filesystem
	// is frozen for the copy and cleared with the copy's completion: a
	// record still Creating with it set was interrupted while the source
	// was frozen, and whoever undoes it thaws the source.
	Frozen bool `json:"frozen,omitempty"`
}

// Format records the filesystem made on a volume.
type Format struct {
	FsType string `json:"fsType"`
	Done   bool   `json:"done"`
}

// Stage records an activated volume.
type Stage struct {
	Phase       Phase  `json:"phase"`
	StagingPath string `json:"stagingPath"`
	Block       bool   `json:"block,omitempty"`
	ReadOnly    bool   `json:"readOnly,omitempty"`
	// Source is the state of the volume's source kind (loop device identity,
	// chain mounts, ...), opaque to the journal.
	Source json.RawMessage `json:"source,omitempty"`
}

// Publish records a kubelet publish at a target path in the host namespace.
type Publish struct {
	TargetPath string       `json:"targetPath"`
	ReadOnly   bool         `json:"readOnly,omitempty"`
	Mounts     []plan.Mount `json:"mounts"`
	// CreatedTarget says the plugin made the target (a directory, or a
	// file for block access): unpublish removes it, and nothing else.
	CreatedTarget bool `json:"createdTarget,omitempty"`
	// Asked is when the mounter was last asked to perform the plan here.
	// The record is written before that: after a crash of the plugin or
	// the mounter, a target that is not mounted yet may still be, since
	// the mounter may still be at work.
	Asked time.Time `json:"asked,omitzero"`
	// NRI marks a publish for containers only: Mounts is what stands at the
	// target instead of the volume (a guard, or for block access the plan
	// whose device node is there), and each container's runtime gets the
	// volume's plan, built with MountFlags (the CO's mount flags).
	NRI        bool     `json:"nri,omitempty"`
	MountFlags []string `json:"mountFlags,omitempty"`
}

// Claim records a consumer of a prepared plan (with the identity of its
// mount namespace) and the plan it received.
type Claim struct {
	plan.Consumer
	Mounts []plan.Mount `json:"mounts"`
}

// Staged reports whether the volume's stage completed.
func (v *Volume) Staged() bool { return v.Stage != nil && v.Stage.Phase == PhaseStaged }

// Durability says what a write must survive.
type Durability int

const (
	// Runtime records describe kernel state (attached devices, mounts,
	// namespaces) that a reboot erases too. Their writes survive a crash
	// of the plugin (the page cache outlives the process) but skip fsync:
	// an existing record of up to a page is rewritten in place with one
	// write, a new or larger one goes through a temp file and a rename.
	// After a machine crash the reconciler finds the devices and mounts
	// gone whatever the record says, and Get falls back to the durable
	// copy if the record is torn.
	Runtime Durability = iota
	// Durable records describe what is on disk (an image exists, a format
	// is under way) and survive a machine crash: fsync of the file and its
	// directory.
	Durable
)

// Store reads and writes records in a directory.
type Store struct {
	dir string
}

// Open prepares dir/volumes and returns a store over it.
func Open(stateDir string) (*Store, error) {
	dir := filepath.Join(stateDir, "volumes")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	return &Store{dir: dir}, nil
}

// ValidID accepts IDs that are safe as a file name: 1 to 128 characters of
// [A-Za-z0-9._-], not starting with a dot.
func ValidID(id string) error {
	if id == "" || len(id) > 128 || strings.HasPrefix(id, ".") ||
		strings.IndexFunc(id, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
		}) >= 0 {
		return fmt.Errorf("volume id %q must be 1-128 characters of [A-Za-z0-9._-] not starting with '.': %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (s *Store) path(id string) string { return filepath.Join(s.dir, id+".json") }

// durableCopy is where the last durable write of a record is kept as
// well: the fallback when a runtime rewrite in place was torn by a
// machine crash (see overwriteInPlace).
func (s *Store) durableCopy(id string) string { return s.path(id) + ".durable" }

// Get returns the record of id, or an error wrapping errdefs.ErrNotFound.
func (s *Store) Get(id string) (*Volume, error) {
	if err := ValidID(id); err != nil {
		return nil, err
	}
	v, err := readRecord(s.path(id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("volume %s: %w", id, errdefs.ErrNotFound)
	}
	if err == nil {
		return v, nil
	}
	// A record that does not parse was being rewritten in place when the
	// machine went down. Its runtime part described devices and mounts
	// that went down with it; the durable copy holds what is on disk.
	if dv, derr := readRecord(s.durableCopy(id)); derr == nil {
		return dv, nil
	}
	return nil, fmt.Errorf("journal: record %s: %w", id, err)
}

func readRecord(path string) (*Volume, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	v := &Volume{}
	if err := json.Unmarshal(b, v); err != nil {
		return nil, fmt.Errorf("%s is corrupt: %w", filepath.Base(path), err)
	}
	return v, nil
}

// Put writes v atomically: after a crash the file holds either the old or
// the new record, never a mix. d says whether it must survive a machine crash.
func (s *Store) Put(v *Volume, d Durability) error {
	_, err := s.PutRecord(v, d)
	return err
}

// PutRecord is Put that also returns the record as written (v in JSON),
// for a caller that keeps it: one encoding serves both.
func (s *Store) PutRecord(v *Volume, d Durability) ([]byte, error) {
	if err := ValidID(v.ID); err != nil {
		return nil, err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	if d == Durable {
		err = writeRecord(s.path(v.ID), b, true)
		if err == nil {
			err = writeRecord(s.durableCopy(v.ID), b, true)
		}
	} else {
		var done bool
		if done, err = overwriteInPlace(s.path(v.ID), b); !done && err == nil {
			err = writeRecord(s.path(v.ID), b, false)
		}
	}
	if err != nil {
		return nil, err
	}
	return b, nil
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

// Delete removes the record of id; a missing record is not an error.
func (s *Store) Delete(id string, d Durability) error {
	if err := ValidID(id); err != nil {
		return err
	}
	// The record first, so that a crash in between leaves no record
	// whose only trace is an old durable copy.
	for _, p := range []string{s.path(id), s.durableCopy(id)} {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("journal: %w", err)
		}
	}
	if d == Durable {
		return syncDir(s.dir)
	}
	return nil
}

// List returns every record, sorted by ID. Corrupt records are returned in
// the error, not silently skipped.
func (s *Store) List() ([]*Volume, error) {
	ids, err := recordIDs(s.dir)
	if err != nil {
		return nil, err
	}
	var out []*Volume
	var errs []error
	for _, id := range ids {
		v, err := s.Get(id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b *Volume) int { return strings.Compare(a.ID, b.ID) })
	return out, errors.Join(errs...)
}

// recordIDs lists the IDs of the records in dir (<id>.json).
func recordIDs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok && !e.IsDir() && ValidID(id) == nil {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// ReadAll returns the bytes of every record by ID, for a caller that
// decodes each once, later (the driver at start: 10,000 records decoded
// twice were most of a restart's CPU). A record is checked with
// json.Valid, which allocates nothing; one that is not valid JSON (torn by
// a machine crash during a rewrite in place) is replaced by its durable
// copy as Get would, and one without a valid copy is returned in the error.
func (s *Store) ReadAll() (map[string][]byte, error) {
	ids, err := recordIDs(s.dir)
	if err != nil {
		return nil, err
	}
	out := make(map[string][]byte, len(ids))
	var errs []error
	for _, id := range ids {
		b, err := os.ReadFile(s.path(id))
		if err == nil && !json.Valid(b) {
			b, err = nil, fmt.Errorf("journal: record %s: %s is corrupt", id, filepath.Base(s.path(id)))
			if db, derr := os.ReadFile(s.durableCopy(id)); derr == nil && json.Valid(db) {
				b, err = db, nil
			}
		}
		switch {
		case errors.Is(err, fs.ErrNotExist): // deleted since the listing
		case err != nil:
			errs = append(errs, err)
		default:
			out[id] = b
		}
	}
	return out, errors.Join(errs...)
}

// CheckWritable proves the journal can still be written and synced (for
// Probe). It writes .probe in place: what it holds does not matter, and a
// temp file would be left behind by a crash during a Probe.
func (s *Store) CheckWritable() (err error) {
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

// TempFiles lists, by volume ID, the temp files of record writes that a
// crash interrupted (of a record and of its durable copy). Only a caller
// that holds the volume's lock, so that no write of it is under way, may
// remove them.
func (s *Store) TempFiles() (map[string][]string, error) {
	temps, err := fsutil.AtomicTemps(s.dir)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	out := map[string][]string{}
	for name, paths := range temps {
		id, ok := strings.CutSuffix(strings.TrimSuffix(name, ".durable"), ".json")
		if ok && ValidID(id) == nil {
			out[id] = append(out[id], paths...)
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

func syncDir(dir string) error {
	if err := fsutil.SyncDir(dir); err != nil {
		return fmt.Errorf("journal: fsync %s: %w", dir, err)
	}
	return nil
}
