package model

import "time"

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
