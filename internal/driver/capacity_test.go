package driver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/topology"
)

// statfsAvail is df's Avail of the filesystem at dir.
func statfsAvail(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

func segment(kv ...string) *csi.Topology {
	s := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		s[kv[i]] = kv[i+1]
	}
	return &csi.Topology{Segments: s}
}

// TestGetCapacityPerNode: this node's segment (or none, or one that names
// no node) gets the free bytes of the filesystem of the images; another
// node's segment gets nothing.
func TestGetCapacityPerNode(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	tests := []struct {
		name string
		topo *csi.Topology
		free bool
	}{
		{"no topology", nil, true},
		{"this node", segment(topology.Key, "node-a"), true},
		{"this node and a zone", segment(topology.Key, "node-a", "topology.kubernetes.io/zone", "z1"), true},
		{"no node named", segment("topology.kubernetes.io/zone", "z1"), true},
		{"another node", segment(topology.Key, "node-b"), false},
		{"another node in a zone", segment(topology.Key, "node-b", "topology.kubernetes.io/zone", "z1"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := statfsAvail(t, d.opts.StateDir)
			r, err := d.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: tt.topo,
				Parameters: map[string]string{"type": "loop"}})
			if err != nil {
				t.Fatal(err)
			}
			after := statfsAvail(t, d.opts.StateDir)
			got := r.GetAvailableCapacity()
			switch {
			case !tt.free && got != 0:
				t.Errorf("available %d for another node's segment, want 0", got)
			case tt.free && (got < min(before, after) || got > max(before, after)):
				t.Errorf("available %d, want the state dir's free bytes (%d before, %d after)", got, before, after)
			case tt.free && got == 0:
				t.Error("available 0 on a filesystem with room")
			}
			if r.GetMaximumVolumeSize() != nil {
				t.Errorf("maximum_volume_size %v: the scheduler would take it for the node's room", r.GetMaximumVolumeSize())
			}
		})
	}
}

// TestGetCapacityParameters: the parameters and capabilities decide the
// filesystem, hence the smallest volume; a class CreateVolume would refuse
// is refused alike.
func TestGetCapacityParameters(t *testing.T) {
	d, _ := newTestDriver(t)
	ctx := context.Background()
	unknownMode := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_UNKNOWN}}
	tests := []struct {
		name    string
		params  map[string]string
		caps    []*csi.VolumeCapability
		minimum int64
		code    codes.Code
		msg     string
	}{
		{"empty request", nil, nil, 16 << 20, codes.OK, ""},
		{"the chart's class", map[string]string{"type": "loop", "csi.storage.k8s.io/fstype": "ext4"}, nil, 16 << 20, codes.OK, ""},
		{"xfs class", map[string]string{"type": "loop", "csi.storage.k8s.io/fstype": "xfs"}, nil, 300 << 20, codes.OK, ""},
		{"fsType parameter", map[string]string{"fsType": "xfs"}, nil, 300 << 20, codes.OK, ""},
		{"nri class", map[string]string{"type": "loop", "nri": "true"}, nil, 16 << 20, codes.OK, ""},
		{"other reserved keys", map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "s"}, nil, 16 << 20, codes.OK, ""},
		{"capability fsType, access mode unknown", nil, []*csi.VolumeCapability{unknownMode}, 300 << 20, codes.OK, ""},
		{"block capability", nil, []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}}, 16 << 20, codes.OK, ""},
		{"unknown parameter", map[string]string{"pool": "fast"}, nil, 0, codes.InvalidArgument, `unknown parameter "pool"`},
		{"type that is not provisioned", map[string]string{"type": "nbd"}, nil, 0, codes.InvalidArgument, `type="nbd"`},
		{"fsType that cannot be made", map[string]string{"fsType": "btrfs"}, nil, 0, codes.InvalidArgument, `"btrfs"`},
		{"bad nri", map[string]string{"nri": "maybe"}, nil, 0, codes.InvalidArgument, "nri"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := d.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: tt.params, VolumeCapabilities: tt.caps})
			if got := errdefs.Code(err); got != tt.code {
				t.Fatalf("code %v (%v), want %v", got, err, tt.code)
			}
			if err != nil {
				if !strings.Contains(err.Error(), tt.msg) {
					t.Errorf("error %q does not say %q", err, tt.msg)
				}
				return
			}
			if got := r.GetMinimumVolumeSize().GetValue(); got != tt.minimum {
				t.Errorf("minimum_volume_size %d, want %d", got, tt.minimum)
			}
			if r.GetAvailableCapacity() <= 0 {
				t.Errorf("available %d", r.GetAvailableCapacity())
			}
		})
	}
	// Another node's segment still gets the smallest size of the class.
	r, err := d.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: segment(topology.Key, "node-b"),
		Parameters: map[string]string{"fsType": "xfs"}})
	if err != nil || r.GetAvailableCapacity() != 0 || r.GetMinimumVolumeSize().GetValue() != 300<<20 {
		t.Errorf("another node, xfs: %v %v", r, err)
	}
}

// TestImageDir: capacity is the filesystem's that holds the images, once
// their directory exists; the state dir's before (it will hold it).
func TestImageDir(t *testing.T) {
	d, _ := newTestDriver(t)
	p, err := d.parseClass(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(d.opts.StateDir, "images", "provisioned")
	if _, err := os.Stat(dir); err == nil {
		t.Fatalf("%s exists before any volume", dir)
	}
	if got := d.imageDir(p); got != d.opts.StateDir {
		t.Errorf("image dir %s before it exists, want the state dir %s", got, d.opts.StateDir)
	}
	if _, err := d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}}); err != nil {
		t.Fatal(err)
	}
	if got := d.imageDir(p); got != dir {
		t.Errorf("image dir %s, want %s (where CreateVolume put the image)", got, dir)
	}
}
