package driver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/topology"
)

// GetCapacity reports the free bytes of the filesystem that holds the
// images CreateVolume would make for the request's parameters, on this
// node: a plugin of one node answers for its own topology segment and has
// nothing in another's (external-provisioner with --node-deployment asks
// each node's plugin for that node's segment alone, but nothing stops a
// CO from asking for another). Images are sparse, so free bytes are what
// new volumes can still be written into; a claim not yet written takes
// nothing from them.
//
// minimum_volume_size is the smallest image the fsType can be made on.
// maximum_volume_size stays unset: the only bound of one volume is the
// filesystem's whole size (checkFits), and the Kubernetes scheduler takes
// a CSIStorageCapacity's maximumVolumeSize instead of its capacity when it
// is set, so reporting it would make every node look as empty as it is
// large.
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	// Access modes do not change where an image goes: the capabilities
	// are read for an fsType only (external-provisioner sends none, older
	// ones sent an UNKNOWN mode).
	p, err := d.parseClass(req.GetParameters(), req.GetVolumeCapabilities())
	if err != nil {
		return nil, err
	}
	minimum := wrapperspb.Int64(roundCapacity(0, p.fsType))
	if !d.holdsSegment(req.GetAccessibleTopology()) {
		return &csi.GetCapacityResponse{AvailableCapacity: 0, MinimumVolumeSize: minimum}, nil
	}
	free, err := freeBytes(d.imageDir(p))
	if err != nil {
		return nil, err
	}
	return &csi.GetCapacityResponse{AvailableCapacity: free, MinimumVolumeSize: minimum}, nil
}

// holdsSegment says whether a topology segment is this node's: one that
// names this node, or one that names no node at all (as checkTopology
// reads a requisite segment).
func (d *Driver) holdsSegment(t *csi.Topology) bool {
	n, ok := t.GetSegments()[topology.Key]
	return !ok || n == d.opts.NodeID
}

// imageDir is the directory the source of p makes a provisioned volume's
// image in, or the state dir while that directory does not exist yet (the
// first CreateVolume makes it, in the state dir's filesystem).
func (d *Driver) imageDir(p createParams) string {
	dir := filepath.Dir(p.prov.ImagePath(model.KindProvisioned, "capacity"))
	if err := unix.Statfs(dir, &unix.Statfs_t{}); errors.Is(err, unix.ENOENT) {
		return d.opts.StateDir
	}
	return dir
}

// freeBytes is the free space of the filesystem at dir as df's Avail
// counts it (f_bavail): the blocks ext4 reserves for root are left to the
// node.
func freeBytes(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	if st.Bsize <= 0 {
		return 0, fmt.Errorf("statfs %s: block size %d", dir, st.Bsize)
	}
	if st.Bavail > uint64(math.MaxInt64/st.Bsize) {
		return math.MaxInt64, nil
	}
	return int64(st.Bavail) * st.Bsize, nil
}
