// Package sourcetest helps test volume sources without a driver.
package sourcetest

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Recorder is a source.Recorder that keeps what a source records, as the
// driver would in the volume's record.
type Recorder struct {
	mu      sync.Mutex
	Formats []model.Format
	Durable int // how many of them were asked to be durable
	Intents []json.RawMessage
}

var _ source.Recorder = (*Recorder)(nil)

func (r *Recorder) SetFormat(f model.Format, durable bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Formats = append(r.Formats, f)
	if durable {
		r.Durable++
	}
	return nil
}

func (r *Recorder) SaveIntent(state json.RawMessage) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Intents = append(r.Intents, state)
	return nil
}

// Saves counts every write the source asked for.
func (r *Recorder) Saves() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.Formats) + len(r.Intents)
}

// Staged returns v as staged with state, as the driver records a stage's
// result.
func Staged(v source.Volume, state json.RawMessage) source.Volume {
	v.Staging, v.State = true, state
	return v
}

// Host is a source.Host that keeps shared records in memory, for sources
// tested without a driver. It has no volumes: Reattach and WithVolume
// fail.
type Host struct {
	mu     sync.Mutex
	shared map[string][]byte // kind + "/" + key
}

var _ source.Host = (*Host)(nil)

func (h *Host) Reattach(context.Context, string, plan.Heal) (plan.HealResult, error) {
	return plan.HealResult{}, errNoVolumes
}

func (h *Host) WithVolume(context.Context, string, string, func(source.Volume, bool, source.Recorder) error) error {
	return errNoVolumes
}

var errNoVolumes = errors.New("sourcetest.Host keeps no volumes")

// WithShared runs fn with every shared record locked.
func (h *Host) WithShared(_ context.Context, kind, key, _ string, fn func([]byte, func([]byte) error) error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.shared == nil {
		h.shared = map[string][]byte{}
	}
	id := kind + "/" + key
	return fn(h.shared[id], func(b []byte) error {
		if b == nil {
			delete(h.shared, id)
		} else {
			h.shared[id] = append([]byte(nil), b...)
		}
		return nil
	})
}

func (h *Host) SharedKeys(kind string) ([]string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var keys []string
	for id := range h.shared {
		if k, ok := strings.CutPrefix(id, kind+"/"); ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// Shared returns a shared record (nil: none).
func (h *Host) Shared(kind, key string) []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.shared[kind+"/"+key]
}
