package driver

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestRefusalsSayWhatToDo: a refused fs_type lists the accepted ones, a
// refused access mode the supported modes, and a volume at its consumer
// limit says the limit, that it is fixed, and what to do instead.
func TestRefusalsSayWhatToDo(t *testing.T) {
	mount := func(fsType string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}}}
	}
	_, err := checkCapability(mount("zfs", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER))
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("fs_type zfs: %v", err)
	}
	for _, typ := range plan.DefaultTypes {
		if !strings.Contains(err.Error(), typ) {
			t.Errorf("%q does not list the supported type %s", err, typ)
		}
	}
	_, err = checkCapability(mount("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER))
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "SINGLE_NODE_WRITER") || !strings.Contains(err.Error(), "ReadWriteOncePod") {
		t.Errorf("access mode MULTI_NODE_MULTI_WRITER: %v, want the supported modes listed", err)
	}
	v := &model.Volume{ID: "v1", Consumers: make([]model.Claim, MaxConsumers)}
	err = roomForConsumer(v)
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a full volume: %v", err)
	}
	for _, want := range []string{strconv.Itoa(MaxConsumers), "not a setting", "mountplan-sidecar unmount", "volume of their own"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
	if err := roomForConsumer(&model.Volume{ID: "v2", Consumers: make([]model.Claim, MaxConsumers-1)}); err != nil {
		t.Errorf("a volume one below the limit: %v", err)
	}
}
