package driver

import (
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/pkg/plan"
)

const (
	podLabel   = "system_u:object_r:container_file_t:s0:c1,c2"
	otherLabel = "system_u:object_r:container_file_t:s0:c3,c4"
)

func capWithFlags(flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

// TestCapabilityTakesKubeletsContext: kubelet's SELinuxMount flag is
// accepted as it writes it, and a context= that is anything but one label
// is InvalidArgument.
func TestCapabilityTakesKubeletsContext(t *testing.T) {
	c, err := checkCapability(capWithFlags("noatime", `context="`+podLabel+`"`))
	if err != nil || c.seLinuxContext != podLabel {
		t.Fatalf("kubelet's context flag: %q, %v", c.seLinuxContext, err)
	}
	for _, bad := range []string{
		`context=` + podLabel, // a comma outside quotes
		`context="` + podLabel + `",nosuid`,
		"context=\"system_u:object_r:t:s0\nrw\"",
		`context="system_u:object_r:t:s0:c1,dev"`,
		`fscontext="system_u:object_r:t:s0"`,
	} {
		if _, err := checkCapability(capWithFlags(bad)); errdefs.Code(err) != codes.InvalidArgument {
			t.Errorf("mount flag %q: %v, want InvalidArgument", bad, err)
		}
	}
	if _, err := checkCapability(capWithFlags(plan.ContextOption(podLabel), plan.ContextOption(otherLabel))); errdefs.Code(err) != codes.InvalidArgument {
		t.Errorf("two contexts in one request: %v, want InvalidArgument", err)
	}
}

// TestOneLabelPerStagedVolume: a publish or prepare repeats the stage's
// label or gets it; another label is refused naming both.
func TestOneLabelPerStagedVolume(t *testing.T) {
	staged := func(label string) *model.Volume {
		return &model.Volume{ID: "v", Stage: &model.Stage{Phase: model.PhaseStaged, SELinuxContext: label}}
	}
	tests := []struct {
		name   string
		stage  string
		flags  []string
		want   codes.Code
		wanted string // the label the plan carries
	}{
		{"same label", podLabel, []string{plan.ContextOption(podLabel)}, codes.OK, podLabel},
		{"none asked gets the stage's", podLabel, []string{"noatime"}, codes.OK, podLabel},
		{"none at all", "", []string{"noatime"}, codes.OK, ""},
		{"another label", podLabel, []string{plan.ContextOption(otherLabel)}, codes.FailedPrecondition, ""},
		{"a label on a volume staged without", "", []string{plan.ContextOption(podLabel)}, codes.FailedPrecondition, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			flags, err := withContext(staged(tc.stage), tc.flags)
			if errdefs.Code(err) != tc.want {
				t.Fatalf("withContext: %v, want %s", err, tc.want)
			}
			if err != nil {
				return
			}
			if got, _ := plan.ContextOf(flags); got != tc.wanted {
				t.Fatalf("the plan's flags %q carry label %q, want %q", flags, got, tc.wanted)
			}
			if !slices.Contains(flags, "noatime") && slices.Contains(tc.flags, "noatime") {
				t.Fatalf("flags lost: %q", flags)
			}
		})
	}
}
