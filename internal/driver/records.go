package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/keylock"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/pkg/plan"
)

// records is the one owner of the driver's state: the journal's stores
// (volumes, snapshots, the sources' shared records), one lock table for
// all of them, and the last record written (or read at start) of each
// volume.
//
// Every change goes through a holder of the record's lock: an RPC
// (TryLock: a busy record is Aborted) or background work (Lock, waiting,
// bounded by its context). A volume's lock is its ID; a snapshot's and a
// shared record's are keys no volume ID can take (IDs hold no '/'), so a
// snapshot may share its name with a volume. An operation that involves
// both takes the snapshot's lock and then the volume's.
//
// Readers that must not wait for a slow stage (NodeGetVolumeStats,
// NodeGetVolumeHealth, the metrics gauge) get a copy of the last volume
// record committed under the lock, never the file, so they cannot see a
// write in progress (the journal rewrites runtime records in place) nor
// fall back to an older durable copy.
//
// A record this process wrote is kept decoded and handed out as a clone
// (model.Volume.Clone): a publish cycle reads its volume's record four
// times, and decoding the JSON each time was the largest part of the
// driver's own CPU. One read at start is kept as its bytes until it is
// used, so that a restart decodes nothing twice.
type records struct {
	stateDir string
	locks    keylock.Locks
	vols     *journal.Store[model.Volume]
	snaps    *journal.Store[model.Snapshot]

	mu   sync.RWMutex
	last map[string]committed // volume id → the last committed record

	// unreadable are the volume records that did not read at start, for
	// the first reconcile to report.
	unreadable error
}

// openRecords opens the journal and reads every volume record once,
// keeping its bytes: each is decoded when first used (the startup
// reconcile), not here too. Records that do not read are left out
// (unreadable), and Get reports them from the disk.
func openRecords(stateDir string) (*records, error) {
	vols, err := journal.OpenVolumes(stateDir)
	if err != nil {
		return nil, err
	}
	snaps, err := journal.OpenSnapshots(stateDir)
	if err != nil {
		return nil, err
	}
	read, err := vols.ReadAll()
	last := make(map[string]committed, len(read))
	for id, b := range read {
		last[id] = committed{b: b}
	}
	return &records{stateDir: stateDir, vols: vols, snaps: snaps, last: last, unreadable: err}, nil
}

// committed is a volume's last committed record: as written by this
// process (v, never handed out itself nor changed), or as read at start
// (b, decoded at each use).
type committed struct {
	v *model.Volume
	b []byte
}

// TryLock takes volume id's lock for an RPC; a busy volume is Aborted.
func (r *records) TryLock(id, op string) (func(), error) { return r.locks.TryLock(id, op) }

// Lock takes volume id's lock for background work, waiting for it.
func (r *records) Lock(ctx context.Context, id, op string) (func(), error) {
	return r.locks.Lock(ctx, id, op)
}

// Locked takes volume id's lock for an RPC and reads its record. The
// returned func releases the lock and is never nil; a volume without a
// record comes back with an error wrapping errdefs.ErrNotFound.
func (r *records) Locked(id, op string) (*model.Volume, func(), error) {
	unlock, err := r.TryLock(id, op)
	if err != nil {
		return nil, func() {}, err
	}
	v, err := r.Get(id)
	return v, unlock, err
}

// Get returns a copy of volume id's record (errdefs.ErrNotFound when it
// has none). The caller may change the copy; only Put makes a change real.
func (r *records) Get(id string) (*model.Volume, error) {
	if err := model.ValidID(id); err != nil {
		return nil, err
	}
	r.mu.RLock()
	c, ok := r.last[id]
	r.mu.RUnlock()
	if !ok {
		// No record, or one that did not read at start: the journal says which.
		return r.vols.Get(id)
	}
	if c.v != nil {
		return c.v.Clone(), nil
	}
	v := &model.Volume{}
	if err := json.Unmarshal(c.b, v); err != nil {
		// Read at start and valid JSON, but not a record: the journal
		// falls back to the durable copy, or says what is wrong.
		return r.vols.Get(id)
	}
	return v, nil
}

// Put writes v to the journal, then makes it what readers see. The
// caller holds v's lock.
func (r *records) Put(v *model.Volume, d journal.Durability) error {
	if _, err := r.vols.Put(v.ID, v, d); err != nil {
		return err
	}
	c := committed{v: v.Clone()} // the caller goes on changing v
	r.mu.Lock()
	r.last[v.ID] = c
	r.mu.Unlock()
	return nil
}

// Delete removes volume id's record. The caller holds id's lock.
func (r *records) Delete(id string, d journal.Durability) error {
	if err := r.vols.Delete(id, d); err != nil {
		return err
	}
	r.mu.Lock()
	delete(r.last, id)
	r.mu.Unlock()
	return nil
}

// IDs returns the ID of every volume record, sorted.
func (r *records) IDs() []string {
	r.mu.RLock()
	ids := make([]string, 0, len(r.last))
	for id := range r.last {
		ids = append(ids, id)
	}
	r.mu.RUnlock()
	slices.Sort(ids)
	return ids
}

// List returns a copy of every volume record, sorted by ID.
func (r *records) List() ([]*model.Volume, error) {
	ids := r.IDs()
	out := make([]*model.Volume, 0, len(ids))
	var errs []error
	for _, id := range ids {
		v, err := r.Get(id)
		switch {
		case errors.Is(err, errdefs.ErrNotFound):
			// deleted since the IDs were taken
		case err != nil:
			errs = append(errs, err)
		default:
			out = append(out, v)
		}
	}
	return out, errors.Join(errs...)
}

// TempFiles lists the temp files of volume record writes a crash
// interrupted, by volume ID.
func (r *records) TempFiles() (map[string][]string, error) { return r.vols.TempFiles() }

// CheckWritable proves the journal can still be written (for Probe).
func (r *records) CheckWritable() error { return r.vols.CheckWritable() }

// snapshotKey is the lock of snapshot id.
func snapshotKey(id string) string { return "snapshot/" + id }

// TryLockSnapshot takes snapshot id's lock for an RPC; a busy snapshot is
// Aborted.
func (r *records) TryLockSnapshot(id, op string) (func(), error) {
	return r.locks.TryLock(snapshotKey(id), op)
}

// Snapshot returns snapshot id's record (errdefs.ErrNotFound when it has
// none).
func (r *records) Snapshot(id string) (*model.Snapshot, error) { return r.snaps.Get(id) }

// PutSnapshot writes snap's record, durably: what it describes is on
// disk. The caller holds its lock.
func (r *records) PutSnapshot(snap *model.Snapshot) error {
	_, err := r.snaps.Put(snap.ID, snap, journal.Durable)
	return err
}

// DeleteSnapshot removes snapshot id's record durably. The caller holds
// its lock.
func (r *records) DeleteSnapshot(id string) error { return r.snaps.Delete(id, journal.Durable) }

// Snapshots returns every snapshot record, sorted by ID.
func (r *records) Snapshots() ([]*model.Snapshot, error) { return r.snaps.List() }

// SnapshotTempFiles lists the temp files of snapshot record writes a
// crash interrupted, by snapshot ID.
func (r *records) SnapshotTempFiles() (map[string][]string, error) { return r.snaps.TempFiles() }

// WithShared runs fn holding the lock of a source's shared record kind/key,
// waiting for it, with the record (nil: none) and save, which writes it
// durably (nil: deletes it).
func (r *records) WithShared(ctx context.Context, kind, key, op string, fn func(data []byte, save func([]byte) error) error) error {
	store, err := journal.Shared(r.stateDir, kind)
	if err != nil {
		return err
	}
	unlock, err := r.locks.Lock(ctx, "shared/"+kind+"/"+key, op)
	if err != nil {
		return err
	}
	defer unlock()
	rec, err := store.Get(key)
	var data []byte
	switch {
	case err == nil:
		data = *rec
	case !errors.Is(err, errdefs.ErrNotFound):
		return err
	}
	return fn(data, func(b []byte) error {
		if b == nil {
			return store.Delete(key, journal.Durable)
		}
		_, err := store.Put(key, (*json.RawMessage)(&b), journal.Durable)
		return err
	})
}

// SharedKeys lists the keys of a source's shared records of kind, sorted.
func (r *records) SharedKeys(kind string) ([]string, error) {
	store, err := journal.Shared(r.stateDir, kind)
	if err != nil {
		return nil, err
	}
	return store.Keys()
}

func findPublish(v *model.Volume, target string) *model.Publish {
	i := slices.IndexFunc(v.Publishes, func(p model.Publish) bool { return p.TargetPath == target })
	if i < 0 {
		return nil
	}
	return &v.Publishes[i]
}

func describeConsumers(cs []model.Claim) string {
	parts := make([]string, 0, len(cs))
	for _, c := range cs {
		parts = append(parts, c.Consumer.String())
	}
	return strings.Join(parts, ", ")
}

// sameConsumer matches the record of the same namespace and mount point,
// or of the same container and mount point.
func sameConsumer(a plan.Consumer) func(model.Claim) bool {
	return func(b model.Claim) bool {
		if a.ContainerID != "" || b.ContainerID != "" {
			return a.ContainerID == b.ContainerID && a.MountPoint == b.MountPoint
		}
		return a.Namespace == b.Namespace && a.MountPoint == b.MountPoint
	}
}

// MaxConsumers bounds the consumers of one volume: every container of a
// node at once stays far below it, and a caller that records claims
// without end (a loop, a hostile caller of NodePrepare) meets a clear
// error instead of a record that grows with every call.
const MaxConsumers = 4096

// roomForConsumer refuses one more consumer of v beyond MaxConsumers.
func roomForConsumer(v *model.Volume) error {
	if len(v.Consumers) >= MaxConsumers {
		return fmt.Errorf("volume %s has %d consumers already, the most one volume may have (a fixed limit, not a setting): "+
			"release those no longer used (mountplan-sidecar unmount; the reconciler forgets consumers whose mount namespace is gone) or give the new consumers a volume of their own: %w",
			v.ID, len(v.Consumers), errdefs.ErrResourceExhausted)
	}
	return nil
}

// pendingContainer reports whether c is a container whose process has not
// been seen yet: it has no namespace to check, and counts as alive until
// its runtime's hook releases it (or NodeSyncContainers finds it gone).
func pendingContainer(c plan.Consumer) bool {
	return c.ContainerID != "" && c.Namespace.Inode == 0
}
