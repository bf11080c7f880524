package plan

import (
	"fmt"
	"math"
	"slices"

	"github.com/mountplan/mountplan/internal/errdefs"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// ToProto converts a plan to its wire form.
func ToProto(mounts []Mount) []*api.Mount {
	out := make([]*api.Mount, 0, len(mounts))
	for _, m := range mounts {
		out = append(out, &api.Mount{Type: m.Type, Source: m.Source, Target: m.Target, Options: slices.Clone(m.Options)})
	}
	return out
}

// FromProto converts a plan from its wire form. Nil entries are skipped; a
// plan that ends up empty fails Validate.
func FromProto(in []*api.Mount) []Mount {
	out := make([]Mount, 0, len(in))
	for _, m := range in {
		if m == nil {
			continue
		}
		out = append(out, Mount{Type: m.GetType(), Source: m.GetSource(), Target: m.GetTarget(), Options: slices.Clone(m.GetOptions())})
	}
	return out
}

// ConsumerToProto converts a consumer to its wire form.
func ConsumerToProto(c Consumer) *api.Consumer {
	return &api.Consumer{Pid: int64(c.PID), MountPoint: c.MountPoint, MntNsInode: c.Namespace.Inode, MntNsId: c.Namespace.ID, ContainerId: c.ContainerID}
}

// ConsumerFromProto converts a consumer from its wire form and validates
// it (Consumer.Validate). A missing consumer or a PID out of range is an
// errdefs.ErrInvalidArgument.
func ConsumerFromProto(c *api.Consumer) (Consumer, error) {
	if c == nil {
		return Consumer{}, fmt.Errorf("consumer is required: %w", errdefs.ErrInvalidArgument)
	}
	if c.GetPid() < 0 || c.GetPid() > math.MaxInt32 {
		return Consumer{}, fmt.Errorf("consumer pid %d is out of range: %w", c.GetPid(), errdefs.ErrInvalidArgument)
	}
	out := Consumer{PID: int(c.GetPid()), MountPoint: c.GetMountPoint(), Namespace: Namespace{Inode: c.GetMntNsInode(), ID: c.GetMntNsId()},
		ContainerID: c.GetContainerId()}
	return out, out.Validate()
}
