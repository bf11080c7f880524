// Package topology names the CSI topology of a mountplan node: the plugin
// answers it (NodeGetInfo, CreateVolume) and the resizer looks for it on
// PersistentVolumes, without either linking the other.
package topology

// Key is the segment that pins a volume to the node that made it.
const Key = "topology.mountplan.csi.io/node"
