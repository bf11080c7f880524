package driver

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

// healthSource is a fakeSource whose health the test sets.
type healthSource struct {
	fakeSource
	h source.Health
}

func (s *healthSource) Health(context.Context, source.Volume) source.Health { return s.h }

// TestVolumeHealthStatus: NodeGetVolumeHealth turns a source's health into
// CSI's: nothing for a healthy or unstaged volume, INACCESSIBLE for an
// abnormal one, DATA_LOSS where the source says the data goes; NotFound
// for a volume without a record.
func TestVolumeHealthStatus(t *testing.T) {
	d, _ := newTestDriver(t)
	src := &healthSource{}
	d.sources["fake"] = src
	staged := &model.Volume{ID: "staged", Kind: model.KindProvisioned, Type: "fake",
		Stage: &model.Stage{Phase: model.PhaseStaged, Source: json.RawMessage(`{}`)}}
	unstaged := &model.Volume{ID: "unstaged", Kind: model.KindProvisioned, Type: "fake"}
	for _, v := range []*model.Volume{staged, unstaged} {
		if err := d.records.Put(v, journal.Runtime); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		id     string
		h      source.Health
		want   csi.VolumeHealthErrorType // 0: no status
		reason string
	}{
		{"healthy", "staged", source.Health{}, 0, ""},
		{"inaccessible", "staged", source.Health{Abnormal: true, Reason: "DeviceGone", Message: "m"}, csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceGone"},
		{"data loss", "staged", source.Health{Abnormal: true, DataLoss: true, Reason: "ImageGone", Message: "m"}, csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone"},
		{"unstaged", "unstaged", source.Health{Abnormal: true, Reason: "NotStaged"}, 0, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src.h = tt.h
			resp, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: tt.id})
			if err != nil {
				t.Fatal(err)
			}
			got := resp.GetVolumeHealth().GetHealthStatuses()
			if resp.GetVolumeHealth().GetVolumeId() != tt.id {
				t.Fatalf("answered for %q", resp.GetVolumeHealth().GetVolumeId())
			}
			if tt.want == 0 {
				if len(got) != 0 {
					t.Fatalf("statuses %v, want none", got)
				}
				return
			}
			if len(got) != 1 || got[0].GetStatus() != tt.want || got[0].GetReason() != tt.reason || got[0].GetMessage() != tt.h.Message {
				t.Fatalf("statuses %v, want one %s %s", got, tt.want, tt.reason)
			}
		})
	}
	if _, err := d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "none"}); errdefs.Code(err) != codes.NotFound {
		t.Fatalf("unknown volume: %v, want NotFound", err)
	}
}
