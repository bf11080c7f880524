// Package sourcetest helps test volume sources without a driver.
package sourcetest

import (
	"encoding/json"
	"sync"

	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/source"
)

// Recorder is a source.Recorder that keeps what a source records, as the
// driver would in the volume's record.
type Recorder struct {
	mu      sync.Mutex
	Formats []journal.Format
	Durable int // how many of them were asked to be durable
	Intents []json.RawMessage
}

var _ source.Recorder = (*Recorder)(nil)

func (r *Recorder) SetFormat(f journal.Format, durable bool) error {
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
