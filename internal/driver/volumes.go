package driver

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/keylock"
	"github.com/mountplan/mountplan/internal/model"
)

// volumes is the one owner of volume state: the journal on disk, one lock
// per volume, and the last record written (or read at start) of each.
//
// Every change goes through a holder of the volume's lock: an RPC
// (TryLock: a busy volume is Aborted) or background work (Lock, waiting,
// bounded by its context). Readers that must not wait for a slow stage
// (NodeGetVolumeStats, NodeGetVolumeHealth, the metrics gauge) get a copy
// of the last record committed under the lock, never the file, so they
// cannot see a write in progress (the journal rewrites runtime records in
// place) nor fall back to an older durable copy.
type volumes struct {
	store *journal.Store[model.Volume]
	locks keylock.Locks

	mu   sync.RWMutex
	last map[string][]byte // id → JSON of the last committed record

	// unreadable are the records that did not read at start, for the
	// first reconcile to report.
	unreadable error
}

// openVolumes opens the journal and reads every record once, keeping its
// bytes: each is decoded when first used (the startup reconcile), not
// here too. Records that do not read are left out (unreadable), and Get
// reports them from the disk.
func openVolumes(stateDir string) (*volumes, error) {
	store, err := journal.OpenVolumes(stateDir)
	if err != nil {
		return nil, err
	}
	last, err := store.ReadAll()
	return &volumes{store: store, last: last, unreadable: err}, nil
}

// tryLock takes the volume's lock for an RPC; a busy volume is Aborted.
func (vs *volumes) tryLock(id, op string) (func(), error) { return vs.locks.TryLock(id, op) }

// lock takes the volume's lock for background work, waiting for it.
func (vs *volumes) lock(ctx context.Context, id, op string) (func(), error) {
	return vs.locks.Lock(ctx, id, op)
}

// Get returns a copy of id's record (errdefs.ErrNotFound when it has
// none). The caller may change the copy; only Put makes a change real.
func (vs *volumes) Get(id string) (*model.Volume, error) {
	if err := model.ValidID(id); err != nil {
		return nil, err
	}
	vs.mu.RLock()
	b, ok := vs.last[id]
	vs.mu.RUnlock()
	if !ok {
		// No record, or one that did not read at start: the journal says which.
		return vs.store.Get(id)
	}
	v := &model.Volume{}
	if err := json.Unmarshal(b, v); err != nil {
		// Read at start and valid JSON, but not a record: the journal
		// falls back to the durable copy, or says what is wrong.
		return vs.store.Get(id)
	}
	return v, nil
}

// Put writes v to the journal, then makes it what readers see. The
// caller holds v's lock.
func (vs *volumes) Put(v *model.Volume, d journal.Durability) error {
	b, err := vs.store.Put(v.ID, v, d)
	if err != nil {
		return err
	}
	vs.mu.Lock()
	vs.last[v.ID] = b
	vs.mu.Unlock()
	return nil
}

// Delete removes id's record. The caller holds id's lock.
func (vs *volumes) Delete(id string, d journal.Durability) error {
	if err := vs.store.Delete(id, d); err != nil {
		return err
	}
	vs.mu.Lock()
	delete(vs.last, id)
	vs.mu.Unlock()
	return nil
}

// IDs returns the ID of every record, sorted.
func (vs *volumes) IDs() []string {
	vs.mu.RLock()
	ids := make([]string, 0, len(vs.last))
	for id := range vs.last {
		ids = append(ids, id)
	}
	vs.mu.RUnlock()
	slices.Sort(ids)
	return ids
}

// List returns a copy of every record, sorted by ID.
func (vs *volumes) List() ([]*model.Volume, error) {
	ids := vs.IDs()
	out := make([]*model.Volume, 0, len(ids))
	var errs []error
	for _, id := range ids {
		v, err := vs.Get(id)
		switch {
		case errors.Is(err, errdefs.ErrNotFound):
			// deleted since the IDs were taken
		case err != nil:
			errs = append(errs, err)
		default:
			out = append(out, v)
		}
	}
	slices.SortFunc(out, func(a, b *model.Volume) int { return strings.Compare(a.ID, b.ID) })
	return out, errors.Join(errs...)
}

// CheckWritable proves the journal can still be written (for Probe).
func (vs *volumes) CheckWritable() error { return vs.store.CheckWritable() }
