package driver

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
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

// healthEntry is one expected health status.
type healthEntry struct {
	status csi.VolumeHealthErrorType
	reason string
}

func entriesOf(h *csi.VolumeHealth) []healthEntry {
	var out []healthEntry
	for _, e := range h.GetHealthStatuses() {
		out = append(out, healthEntry{e.GetStatus(), e.GetReason()})
	}
	return out
}

// putImageVolume records a provisioned volume of the fake type with an
// image of size bytes under dir (size < 0: no image).
func putImageVolume(t *testing.T, d *Driver, dir, id string, size int64, staged bool) *model.Volume {
	t.Helper()
	v := &model.Volume{ID: id, Kind: model.KindProvisioned, Type: "fake", Image: filepath.Join(dir, id+".img"), CapacityBytes: 1 << 20}
	if staged {
		v.Stage = &model.Stage{Phase: model.PhaseStaged, Source: json.RawMessage(`{}`)}
	}
	if size >= 0 {
		if err := os.WriteFile(v.Image, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(v.Image, size); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.records.Put(v, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestControllerVolumeHealth: ControllerGetVolumeHealth reports a volume
// whose image is the one recorded as healthy, an image gone or cut short
// as DATA_LOSS and one that is no file as INACCESSIBLE; a staged volume
// adds what its source says (NodeGetVolumeHealth's answer), each (status,
// reason) once. Volumes the controller does not list are NotFound.
func TestControllerVolumeHealth(t *testing.T) {
	d, _ := newTestDriver(t)
	src := &healthSource{}
	d.sources["fake"] = src
	dir := t.TempDir()
	ctx := context.Background()
	deviceGone := source.Health{Abnormal: true, Reason: "DeviceGone", Message: "m"}
	imageGone := source.Health{Abnormal: true, DataLoss: true, Reason: "ImageGone", Message: "m"}
	for _, tt := range []struct {
		name   string
		size   int64 // < 0: no image
		dir    bool  // the image is a directory
		staged bool
		src    source.Health
		typ    string // "" for the fake source
		want   []healthEntry
	}{
		{name: "healthy", size: 1 << 20},
		{name: "grown", size: 2 << 20},
		{name: "unstaged ignores source", size: 1 << 20, src: deviceGone},
		{name: "gone", size: -1, want: []healthEntry{{csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone"}}},
		{name: "truncated", size: 4096, want: []healthEntry{{csi.VolumeHealthErrorType_DATA_LOSS, "ImageTruncated"}}},
		{name: "directory", size: -1, dir: true, want: []healthEntry{{csi.VolumeHealthErrorType_INACCESSIBLE, "ImageNotAFile"}}},
		{name: "staged healthy", size: 1 << 20, staged: true},
		{name: "staged device gone", size: 1 << 20, staged: true, src: deviceGone,
			want: []healthEntry{{csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceGone"}}},
		{name: "staged device and image gone", size: -1, staged: true, src: deviceGone, want: []healthEntry{
			{csi.VolumeHealthErrorType_INACCESSIBLE, "DeviceGone"}, {csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone"}}},
		{name: "staged image gone once", size: -1, staged: true, src: imageGone,
			want: []healthEntry{{csi.VolumeHealthErrorType_DATA_LOSS, "ImageGone"}}},
		{name: "staged unknown source", size: 1 << 20, staged: true, typ: "gone",
			want: []healthEntry{{csi.VolumeHealthErrorType_INACCESSIBLE, "SourceUnavailable"}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src.h = tt.src
			id := "v-" + strings.ReplaceAll(tt.name, " ", "-")
			v := putImageVolume(t, d, dir, id, tt.size, tt.staged)
			if tt.dir {
				if err := os.Mkdir(v.Image, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			if tt.typ != "" {
				v.Type = tt.typ
				if err := d.records.Put(v, journal.Runtime); err != nil {
					t.Fatal(err)
				}
			}
			resp, err := d.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.GetVolumeHealth().GetVolumeId(); got != id {
				t.Fatalf("answered for %q", got)
			}
			if got := entriesOf(resp.GetVolumeHealth()); !slices.Equal(got, tt.want) {
				t.Fatalf("statuses %v, want %v", got, tt.want)
			}
			for _, e := range resp.GetVolumeHealth().GetHealthStatuses() {
				if e.GetMessage() == "" {
					t.Errorf("%s has no message", e.GetReason())
				}
			}
		})
	}

	static := &model.Volume{ID: "static", Kind: model.KindStatic, Type: "fake", Image: filepath.Join(dir, "static.img")}
	creating := &model.Volume{ID: "creating", Kind: model.KindProvisioned, Type: "fake", Image: filepath.Join(dir, "creating.img"), Creating: true}
	for _, v := range []*model.Volume{static, creating} {
		if err := d.records.Put(v, journal.Runtime); err != nil {
			t.Fatal(err)
		}
	}
	for _, tt := range []struct {
		id   string
		want codes.Code
	}{{"", codes.InvalidArgument}, {"no/such", codes.InvalidArgument}, {"none", codes.NotFound}, {"static", codes.NotFound}, {"creating", codes.NotFound}} {
		if _, err := d.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: tt.id}); errdefs.Code(err) != tt.want {
			t.Errorf("volume %q: %v, want %s", tt.id, err, tt.want)
		}
	}
}

// TestControllerListVolumeHealth: only abnormal volumes are listed, each
// once, in ID order, across pages of any size; a page holds max_entries
// and carries a token while an abnormal volume is left, and none after
// the last. A token this plugin did not make is Aborted, a negative
// max_entries InvalidArgument.
func TestControllerListVolumeHealth(t *testing.T) {
	d, _ := newTestDriver(t)
	d.sources["fake"] = &healthSource{}
	dir := t.TempDir()
	ctx := context.Background()
	var want []string
	for i, id := range []string{"a", "b", "c", "d", "e", "f", "g", "h"} {
		size := int64(1 << 20)
		if i%3 != 1 { // a, c, d, f, g are gone; b, e, h healthy
			size = -1
			want = append(want, id)
		}
		putImageVolume(t, d, dir, id, size, false)
	}
	static := &model.Volume{ID: "static", Kind: model.KindStatic, Type: "fake", Image: filepath.Join(dir, "nothing.img")}
	if err := d.records.Put(static, journal.Runtime); err != nil {
		t.Fatal(err)
	}
	for _, max := range []int32{0, 1, 2, 3, 5, 6} {
		var got []string
		token := ""
		for pages := 0; ; pages++ {
			if pages > len(want) {
				t.Fatalf("max %d: more pages than volumes", max)
			}
			resp, err := d.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: max, StartingToken: token})
			if err != nil {
				t.Fatal(err)
			}
			if max > 0 && len(resp.GetEntries()) > int(max) {
				t.Fatalf("max %d: page of %d", max, len(resp.GetEntries()))
			}
			if resp.GetNextToken() != "" && len(resp.GetEntries()) == 0 {
				t.Fatalf("max %d: empty page with a token", max)
			}
			for _, h := range resp.GetEntries() {
				if len(h.GetHealthStatuses()) == 0 {
					t.Fatalf("max %d: healthy %s listed", max, h.GetVolumeId())
				}
				got = append(got, h.GetVolumeId())
			}
			if token = resp.GetNextToken(); token == "" {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("max %d: listed %v, want %v", max, got, want)
		}
	}
	for _, tt := range []struct {
		req  *csi.ControllerListVolumeHealthRequest
		want codes.Code
	}{
		{&csi.ControllerListVolumeHealthRequest{StartingToken: "bogus"}, codes.Aborted},
		{&csi.ControllerListVolumeHealthRequest{StartingToken: tokenPrefix + "../x"}, codes.Aborted},
		{&csi.ControllerListVolumeHealthRequest{MaxEntries: -1}, codes.InvalidArgument},
	} {
		if _, err := d.ControllerListVolumeHealth(ctx, tt.req); errdefs.Code(err) != tt.want {
			t.Errorf("%v: %v, want %s", tt.req, err, tt.want)
		}
	}
}

// TestControllerHealthCapabilities: the controller offers both health
// RPCs; CSI 1.13 requires GET_VOLUME_HEALTH of a plugin with
// LIST_VOLUME_HEALTH.
func TestControllerHealthCapabilities(t *testing.T) {
	d, _ := newTestDriver(t)
	resp, err := d.ControllerGetCapabilities(context.Background(), &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	} {
		if !slices.ContainsFunc(resp.GetCapabilities(), func(c *csi.ControllerServiceCapability) bool {
			return c.GetRpc().GetType() == want
		}) {
			t.Errorf("controller capabilities lack %s", want)
		}
	}
}
