package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// sourceOf returns the source of v's type: what the driver asks for every
// device step of v, and, through the optional interfaces of
// internal/source, for what else it can do.
func (d *Driver) sourceOf(v *model.Volume) (source.Source, error) {
	s, ok := d.sources[v.Type]
	if !ok {
		return nil, fmt.Errorf("volume %s has unknown type %q: %w", v.ID, v.Type, errdefs.ErrInvalidArgument)
	}
	return s, nil
}

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
	recs *records
	v    *model.Volume
}

func (r recorder) SetFormat(f model.Format, durable bool) error {
	r.v.Format = &f
	if !durable {
		return nil // written with the stage's own final write
	}
	return r.recs.Put(r.v, journal.Durable)
}

func (r recorder) SaveIntent(state json.RawMessage) error {
	if r.v.Stage == nil {
		return fmt.Errorf("volume %s: an intent outside a stage: %w", r.v.ID, errdefs.ErrFailedPrecondition)
	}
	r.v.Stage.Source = slices.Clone(state)
	return r.recs.Put(r.v, journal.Runtime)
}

// adopt makes sure a staged volume's handles are live in this process.
func (d *Driver) adopt(ctx context.Context, v *model.Volume, src source.Source) error {
	state, err := src.Adopt(ctx, viewOf(v))
	if err != nil {
		return err
	}
	if string(state) != string(v.Stage.Source) {
		v.Stage.Source = state
		return d.records.Put(v, journal.Runtime)
	}
	return nil
}

// WithVolume runs a source's background work (a supervisor restarting a
// daemon, an orphan sweep) under the volume's lock, as an RPC would run.
func (d *Driver) WithVolume(ctx context.Context, id, op string, fn func(v source.Volume, found bool, rec source.Recorder) error) error {
	unlock, err := d.records.Lock(ctx, id, op)
	if err != nil {
		return err
	}
	defer unlock()
	v, err := d.records.Get(id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return fn(source.Volume{ID: id}, false, nil)
	}
	if err != nil {
		return err
	}
	return fn(viewOf(v), true, recorder{d.records, v})
}

// WithShared runs fn under the lock of a source's shared record (see
// source.Host).
func (d *Driver) WithShared(ctx context.Context, kind, key, op string, fn func(data []byte, save func([]byte) error) error) error {
	return d.records.WithShared(ctx, kind, key, op, fn)
}

// SharedKeys lists the keys of a source's shared records of kind.
func (d *Driver) SharedKeys(kind string) ([]string, error) { return d.records.SharedKeys(kind) }

// provisioner returns the source of type typ if it makes its volumes'
// images itself (source.Provisioner).
func (d *Driver) provisioner(typ string) (source.Provisioner, bool) {
	p, ok := d.sources[typ].(source.Provisioner)
	return p, ok
}

// provisionerTypes names the types that can be provisioned, for an error.
func (d *Driver) provisionerTypes() string {
	var types []string
	for typ, s := range d.sources {
		if _, ok := s.(source.Provisioner); ok {
			types = append(types, strconv.Quote(typ))
		}
	}
	slices.Sort(types)
	return strings.Join(types, ", ")
}

// provisionerOf returns the source that made v's image.
func (d *Driver) provisionerOf(v *model.Volume) (source.Provisioner, error) {
	if p, ok := d.provisioner(v.Type); ok {
		return p, nil
	}
	return nil, fmt.Errorf("volume %s: %s volumes have no image of this plugin's making: %w", v.ID, v.Type, errdefs.ErrFailedPrecondition)
}

// snapshotterOf returns v's source if its images can be copied.
func (d *Driver) snapshotterOf(v *model.Volume) (source.Snapshotter, error) {
	if sn, ok := d.sources[v.Type].(source.Snapshotter); ok {
		return sn, nil
	}
	return nil, fmt.Errorf("volume %s: %s volumes cannot be copied: %w", v.ID, v.Type, errdefs.ErrFailedPrecondition)
}

// removeImage removes the image of v (a provisioned or inline volume, or
// one whose creation was interrupted); a volume without one has nothing
// to remove.
func (d *Driver) removeImage(v *model.Volume) error {
	if v.Image == "" {
		return nil
	}
	p, err := d.provisionerOf(v)
	if err != nil {
		return err
	}
	return p.RemoveImage(v.Image)
}

// tempImages lists, by volume ID, the temp files of every provisioner's
// image creations that a crash interrupted.
func (d *Driver) tempImages() (map[string][]string, error) {
	out := map[string][]string{}
	var errs []error
	for _, s := range d.sources {
		p, ok := s.(source.Provisioner)
		if !ok {
			continue
		}
		temps, err := p.TempImages()
		errs = append(errs, err)
		for id, paths := range temps {
			out[id] = append(out[id], paths...)
		}
	}
	return out, errors.Join(errs...)
}
