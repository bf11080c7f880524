package nri

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestOCIMounts(t *testing.T) {
	got, err := ociMounts("/data", checkedPlan{[]plan.Mount{
		{Type: "ext4", Source: "/dev/loop7", Options: []string{"nosuid", "nodev"}},
		{Type: plan.TypeBind, Source: "/var/lib/mountplan/fuse/v/mnt", Target: "sub", Options: []string{"nosuid", "nodev", "ro"}},
		{Type: plan.TypeBind, Source: "/var/lib/mountplan/x", Target: "rec", Options: []string{"rec", "nosuid"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := []*nriapi.Mount{
		{Destination: "/data", Type: "ext4", Source: "/dev/loop7", Options: []string{"nosuid", "nodev", "rprivate"}},
		{Destination: "/data/sub", Type: "bind", Source: "/var/lib/mountplan/fuse/v/mnt", Options: []string{"bind", "nosuid", "nodev", "ro", "rprivate"}},
		{Destination: "/data/rec", Type: "bind", Source: "/var/lib/mountplan/x", Options: []string{"rbind", "nosuid", "rprivate"}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d mounts, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Destination != want[i].Destination || got[i].Type != want[i].Type || got[i].Source != want[i].Source || !slices.Equal(got[i].Options, want[i].Options) {
			t.Errorf("mount %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
	if _, err := ociMounts("/dev/xvda", checkedPlan{[]plan.Mount{{Type: plan.TypeBind, Source: "/dev/loop7", Options: []string{"nosuid"}}}}); err == nil {
		t.Error("a device bind was turned into a mount")
	}
}

// The hook's claims travel in the container's annotation: what
// CreateContainer wrote is what StopContainer releases, for the container
// the event names; a container without it, or with garbage, releases
// nothing.
func TestReleaseFromAnnotation(t *testing.T) {
	claims := []Claim{{VolumeID: "v1", Target: "/k/pods/u/volumes/kubernetes.io~csi/pv/mount", Destination: "/data"},
		{VolumeID: "v2", Major: 7, Minor: 3, Destination: "/dev/xvda"}}
	rec, _ := json.Marshal(claims)
	f := &fakeVolumes{}
	h := NewHook(f, nil, "", "")
	ctr := &nriapi.Container{Id: "c1", Annotations: map[string]string{Annotation: string(rec)}}
	if _, err := h.StopContainer(context.Background(), nil, ctr); err != nil {
		t.Fatal(err)
	}
	h.wait()
	if got := f.releases(); len(got) != 2 || got[0].ContainerID != "c1" || got[0].VolumeID != "v1" || got[1].Destination != "/dev/xvda" {
		t.Errorf("released %+v", got)
	}
	for _, a := range []map[string]string{nil, {Annotation: "not json"}} {
		err := h.RemoveContainer(context.Background(), nil, &nriapi.Container{Id: "c2", Annotations: a})
		h.wait()
		if got := f.releases(); err != nil || len(got) != 2 {
			t.Errorf("annotations %v: released %+v, %v", a, got, err)
		}
	}
}

// plainMounter performs plans but cannot check one for the runtime.
type plainMounter struct{}

func (plainMounter) Mount(context.Context, []plan.Mount, plan.Consumer) error   { return nil }
func (plainMounter) Unmount(context.Context, []plan.Mount, plan.Consumer) error { return nil }

// checkingMounter answers every CheckPlan with err.
type checkingMounter struct {
	plainMounter
	err error
}

func (c checkingMounter) CheckPlan(context.Context, []plan.Mount) error { return c.err }

// TestRuntimePlansAreChecked: a plan reaches the runtime only as the
// mounter checked it, and a hook whose mounter cannot check (none, or one
// without CheckPlan) refuses every plan rather than pass it on.
func TestRuntimePlansAreChecked(t *testing.T) {
	mounts := []plan.Mount{{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}}}
	refused := fmt.Errorf("mount 0: %w", errdefs.ErrInvalidArgument)
	for _, tt := range []struct {
		name string
		m    mounter.Interface
		want error
	}{
		{"no mounter", nil, errdefs.ErrPermissionDenied},
		{"a mounter that cannot check", plainMounter{}, errdefs.ErrPermissionDenied},
		{"a mounter that refuses the plan", checkingMounter{err: refused}, errdefs.ErrInvalidArgument},
		{"(control) a mounter that accepts it", checkingMounter{}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := NewHook(&fakeVolumes{}, tt.m, "", "")
			p, err := h.checked(context.Background(), mounts)
			if tt.want == nil {
				if err != nil || !slices.EqualFunc(p.mounts, mounts, func(a, b plan.Mount) bool { return a.String() == b.String() }) {
					t.Fatalf("checked = %v, %v; want the plan", p.mounts, err)
				}
				return
			}
			if !errors.Is(err, tt.want) || p.mounts != nil {
				t.Errorf("checked = %v, %v; want no plan and %v", p.mounts, err, tt.want)
			}
		})
	}
}
