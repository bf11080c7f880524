package driver

import (
	"fmt"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// A snapshot lives on the node that took it: its image is in that node's
// state dir. Its ID, as the CO keeps it (a VolumeSnapshotContent's
// snapshotHandle), names that node after the snapshot's name,
// "<name>@<node>", so that a node asked to restore another node's
// snapshot can tell "it is elsewhere" (ResourceExhausted, CSI's code for a
// topology a volume cannot be made in: the external-provisioner then takes
// the claim's selected node away, so the claim is never tied to the wrong
// node, where NotFound left it for good: csi-driver-host-path #651; the
// scheduler does not learn from it, though) from "there is no such snapshot"
// (NotFound, as CSI says and csi-sanity checks). The name alone is the
// snapshot's key in the records; '@' is in no name (model.ValidID) nor
// node name. An ID without a node (taken before IDs named one, or whose
// name and node exceed CSI's 128 bytes) is this node's.
const snapshotNodeSep = "@"

// maxCSIID is the longest ID CSI lets a plugin return.
const maxCSIID = 128

// snapshotRef is the ID of this node's snapshot name.
func (d *Driver) snapshotRef(name string) string {
	id := name + snapshotNodeSep + d.opts.NodeID
	if len(id) > maxCSIID {
		return name
	}
	return id
}

// localSnapshot returns the name of the snapshot an ID names, and
// elsewhere, the node that holds it when that is not this one.
func (d *Driver) localSnapshot(id string) (name, elsewhere string) {
	name, node, ok := strings.Cut(id, snapshotNodeSep)
	if !ok || node == d.opts.NodeID {
		return name, ""
	}
	return name, node
}

// snapshotElsewhere is the error of a restore asked on a node that does
// not hold the snapshot.
func (d *Driver) snapshotElsewhere(id, node string) error {
	return fmt.Errorf("snapshot %s lives on node %s, not on %s: a volume restored from it can only be made there; "+
		"place the claim's pod on node %s (the claim is rescheduled meanwhile): %w", id, node, d.opts.NodeID, node, errdefs.ErrResourceExhausted)
}
