package model

import (
	"bytes"
	"encoding/json"
	"maps"
	"slices"
	"time"

	"github.com/mountplan/mountplan/pkg/plan"
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
	// Rebooted holds what the record said of a boot that has ended: the
	// stage and publishes, whose devices, sessions, daemons and mounts the
	// reboot took. Set at the plugin's start in a new boot, cleared when
	// kubelet stages the volume again, or when no one asked for it within
	// the reboot grace (docs/state.md, "After a reboot").
	Rebooted *Rebooted `json:"rebooted,omitempty"`
}

// Rebooted is what a reboot erased of a volume's record. Nothing in it
// is trusted against the kernel: a device number, session or PID of an
// ended boot may name something else now.
type Rebooted struct {
	// Boot is the boot the stage and publishes were of.
	Boot string `json:"boot"`
	// Found is when the plugin found the boot had changed: the grace
	// counts from here.
	Found time.Time `json:"found"`
	// Stage is the ended boot's stage, until the source has removed what
	// it left on disk (source.Forgetter); nil after that or if none.
	Stage *Stage `json:"stage,omitempty"`
	// Publishes are the ended boot's publishes: kubelet may unpublish them
	// (the plugin then removes a target it made) or publish them again.
	Publishes []Publish `json:"publishes,omitempty"`
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
	// SELinuxContext is the label the volume was staged with (kubelet's
	// context= mount flag), "" for none: the label of every mount of it.
	// A superblock has one label, and a bind shows the label of the mount
	// it comes from, so a publish or prepare may not ask for another.
	SELinuxContext string `json:"seLinuxContext,omitempty"`
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
	// SingleWriter says the publish asked for SINGLE_NODE_SINGLE_WRITER
	// (ReadWriteOncePod): while it stands, the volume is published nowhere
	// else on the node.
	SingleWriter bool `json:"singleWriter,omitempty"`
	// Pod is the pod kubelet published for (its volume_context, with the
	// CSIDriver's podInfoOnMount), for the operator's listing only.
	Pod Pod `json:"pod,omitzero"`
}

// Claim records a consumer of a prepared plan (with the identity of its
// mount namespace) and the plan it received.
type Claim struct {
	plan.Consumer
	Mounts []plan.Mount `json:"mounts"`
	// Pod is who the consumer is, as its caller said (the NRI hook: the
	// runtime's pod and container), for the operator's listing only.
	Pod Pod `json:"pod,omitzero"`
}

// Pod names a pod (and one of its containers) as kubelet or the container
// runtime told the plugin. Every field is optional (records written before
// it have none); nothing is decided by it, it is only shown.
type Pod struct {
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	UID       string `json:"uid,omitempty"`
	Container string `json:"container,omitempty"`
}

// Staged reports whether the volume's stage completed.
func (v *Volume) Staged() bool { return v.Stage != nil && v.Stage.Phase == PhaseStaged }

// Clone returns a deep copy of v: no map, slice or pointer of it is shared
// with v, so either may be changed without the other seeing it (the
// driver hands out copies of the records it keeps).
func (v *Volume) Clone() *Volume {
	if v == nil {
		return nil
	}
	c := *v
	c.Parameters = maps.Clone(v.Parameters)
	if v.Format != nil {
		f := *v.Format
		c.Format = &f
	}
	c.Stage = cloneStage(v.Stage)
	c.Publishes = clonePublishes(v.Publishes)
	if v.Consumers != nil {
		c.Consumers = make([]Claim, len(v.Consumers))
		for i, cl := range v.Consumers {
			cl.Mounts = cloneMounts(cl.Mounts)
			c.Consumers[i] = cl
		}
	}
	if v.ContentSource != nil {
		cs := *v.ContentSource
		c.ContentSource = &cs
	}
	if v.Rebooted != nil {
		r := *v.Rebooted
		r.Stage = cloneStage(v.Rebooted.Stage)
		r.Publishes = clonePublishes(v.Rebooted.Publishes)
		c.Rebooted = &r
	}
	return &c
}

func cloneStage(s *Stage) *Stage {
	if s == nil {
		return nil
	}
	st := *s
	st.Source = bytes.Clone(s.Source)
	return &st
}

func clonePublishes(ps []Publish) []Publish {
	if ps == nil {
		return nil
	}
	out := make([]Publish, len(ps))
	for i, p := range ps {
		p.Mounts = cloneMounts(p.Mounts)
		p.MountFlags = slices.Clone(p.MountFlags)
		out[i] = p
	}
	return out
}

func cloneMounts(ms []plan.Mount) []plan.Mount {
	if ms == nil {
		return nil
	}
	out := make([]plan.Mount, len(ms))
	for i, m := range ms {
		m.Options = slices.Clone(m.Options)
		out[i] = m
	}
	return out
}
