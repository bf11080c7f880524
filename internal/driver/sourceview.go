package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// viewOf is what v's source sees of it: a copy of the facts and of the
// source's own state, nothing it could change the record through.
func viewOf(v *model.Volume) source.Volume {
	sv := source.Volume{ID: v.ID, Kind: v.Kind, Type: v.Type, Image: v.Image, CapacityBytes: v.CapacityBytes,
		FsType: v.FsType, Parameters: maps.Clone(v.Parameters)}
	if v.Format != nil {
		f := *v.Format
		sv.Format = &f
	}
	if v.Stage != nil {
		sv.Staging, sv.State = true, slices.Clone(v.Stage.Source)
	}
	return sv
}

// recordOf makes the record of a static volume from what its source
// checked (NewVolume); it is not saved yet.
func recordOf(typ string, sv source.Volume) *model.Volume {
	return &model.Volume{ID: sv.ID, Kind: model.KindStatic, Type: typ, Image: sv.Image,
		FsType: sv.FsType, Parameters: sv.Parameters}
}

// recorder writes what a source records of v during a call the driver
// holds v's lock for.
type recorder struct {
	vols *volumes
	v    *model.Volume
}

func (r recorder) SetFormat(f model.Format, durable bool) error {
	r.v.Format = &f
	if !durable {
		return nil // written with the stage's own final write
	}
	return r.vols.Put(r.v, journal.Durable)
}

func (r recorder) SaveIntent(state json.RawMessage) error {
	if r.v.Stage == nil {
		return fmt.Errorf("volume %s: an intent outside a stage: %w", r.v.ID, errdefs.ErrFailedPrecondition)
	}
	r.v.Stage.Source = slices.Clone(state)
	return r.vols.Put(r.v, journal.Runtime)
}

// WithVolume runs a source's background work (a supervisor restarting a
// daemon, an orphan sweep) under the volume's lock, as an RPC would run.
func (d *Driver) WithVolume(ctx context.Context, id, op string, fn func(v source.Volume, found bool, rec source.Recorder) error) error {
	unlock, err := d.vols.lock(ctx, id, op)
	if err != nil {
		return err
	}
	defer unlock()
	v, err := d.vols.Get(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return fn(source.Volume{ID: id}, false, nil)
	}
	if err != nil {
		return err
	}
	return fn(viewOf(v), true, recorder{d.vols, v})
}

// WithShared runs fn under the lock of a source's shared record. The lock
// is the volumes' lock table's, under a key no volume ID can take (IDs
// hold no '/').
func (d *Driver) WithShared(ctx context.Context, kind, key, op string, fn func(data []byte, save func([]byte) error) error) error {
	store, err := journal.Shared(d.opts.StateDir, kind)
	if err != nil {
		return err
	}
	unlock, err := d.vols.lock(ctx, "shared/"+kind+"/"+key, op)
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

// SharedKeys lists the keys of a source's shared records of kind.
func (d *Driver) SharedKeys(kind string) ([]string, error) {
	store, err := journal.Shared(d.opts.StateDir, kind)
	if err != nil {
		return nil, err
	}
	return store.Keys()
}
