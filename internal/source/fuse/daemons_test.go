package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
)

// fakeDaemons records what the source asks of the mounter.
type fakeDaemons struct {
	mu       sync.Mutex
	starts   []mounter.DaemonRequest
	stops    []fakeStop
	startErr error
}

type fakeStop struct {
	id       string
	known    []daemon.Proc
	teardown bool
}

func (f *fakeDaemons) StartDaemon(_ context.Context, req mounter.DaemonRequest) (mounter.DaemonInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.starts = append(f.starts, req)
	if f.startErr != nil {
		return mounter.DaemonInfo{}, f.startErr
	}
	return mounter.DaemonInfo{Proc: daemon.Proc{PID: 1 << 30, StartTime: 1}, Conn: 77, BindSource: "/st/fuse/" + req.VolumeID + "/mnt"}, nil
}

func (f *fakeDaemons) WaitDaemon(ctx context.Context, _ daemon.Proc) error {
	<-ctx.Done()
	return ctx.Err()
}

func (f *fakeDaemons) DaemonStatus(context.Context, daemon.Proc, uint64) (mounter.DaemonStatus, error) {
	return mounter.DaemonStatus{Alive: true}, nil
}

func (f *fakeDaemons) StopDaemons(_ context.Context, id string, known []daemon.Proc, teardown bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stops = append(f.stops, fakeStop{id, known, teardown})
	return nil
}

var _ mounter.Daemons = (*fakeDaemons)(nil)

// The plugin's part of a stage: what the volume or the CO got wrong never
// reaches the mounter; a start that fails is undone through the mounter;
// the mounter is handed the checked parameters and the secrets, and an
// unstage names the daemon the journal recorded.
func TestStageAsksTheMounter(t *testing.T) {
	f := &fakeDaemons{}
	state := t.TempDir()
	s, err := New(Options{StateDir: state, Profiles: exampleProfiles(t), Daemons: f})
	if err != nil {
		t.Fatal(err)
	}
	defer s.stop()
	ctx := context.Background()
	ssh := map[string]string{"profile": "sshfs", "source": "me@example.org:/srv", "port": "2222"}
	secrets := map[string]string{"sshKey": "k", "knownHosts": "h"}
	for name, tt := range map[string]struct {
		params  map[string]string
		secrets map[string]string
		block   bool
	}{
		"unknown option":  {params: map[string]string{"profile": "sshfs", "source": "me@example.org:/srv", "ssh_command": "sh"}, secrets: secrets},
		"missing secret":  {params: ssh, secrets: map[string]string{"sshKey": "k"}},
		"unknown secret":  {params: ssh, secrets: map[string]string{"sshKey": "k", "knownHosts": "h", "token": "t"}},
		"block access":    {params: ssh, secrets: secrets, block: true},
		"unknown profile": {params: map[string]string{"profile": "nfs", "source": "a@b:/c"}},
	} {
		_, err := s.Stage(ctx, source.Volume{ID: "v", Parameters: tt.params}, source.StageRequest{Secrets: tt.secrets, Block: tt.block})
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: Stage = %v, want InvalidArgument", name, err)
		}
	}
	if len(f.starts)+len(f.stops) != 0 {
		t.Errorf("refused stages reached the mounter: %d starts, %d stops", len(f.starts), len(f.stops))
	}
	if _, err := os.Lstat(filepath.Join(state, "fuse")); err == nil {
		t.Error("refused stages made the fuse directory")
	}

	f.startErr = fmt.Errorf("the daemon did not mount: %w", errdefs.ErrUnavailable)
	if _, err := s.Stage(ctx, source.Volume{ID: "v", Parameters: ssh}, source.StageRequest{Secrets: secrets}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("Stage with a failing mounter = %v", err)
	}
	if len(f.starts) != 1 || f.starts[0].Generation != 1 || f.starts[0].Secrets["sshKey"] != "k" || f.starts[0].Params["port"] != "2222" ||
		f.starts[0].Profile != "sshfs" {
		t.Errorf("StartDaemon requests %+v", f.starts)
	}
	if len(f.stops) != 1 || !f.stops[0].teardown || f.stops[0].id != "v" {
		t.Errorf("a failed start is not undone: stops %+v", f.stops)
	}
	if s.supervisorOf("v") != nil {
		t.Error("a failed stage left a supervisor")
	}

	f.startErr = nil
	// A pod's fsGroup (kubelet's volume_mount_group at stage) goes to the
	// mounter, which renders the profile's mountGroupArgs, and is recorded
	// for the restarts.
	gid := uint32(2000)
	raw, err := s.Stage(ctx, source.Volume{ID: "v", Parameters: ssh}, source.StageRequest{Secrets: secrets, ReadOnly: true, MountGroup: &gid})
	if err != nil {
		t.Fatal(err)
	}
	if got := f.starts[len(f.starts)-1].MountGroup; got == nil || *got != gid {
		t.Errorf("StartDaemon's mount group: %v, want %d", got, gid)
	}
	var st State
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	if st.Daemon.PID != 1<<30 || st.Daemon.Generation != 1 || st.Daemon.Conn != 77 || !st.Secrets || !st.ReadOnly ||
		st.BindSource != "/st/fuse/v/mnt" || st.MountGroup == nil || *st.MountGroup != 2000 || st.MountPoint != filepath.Join(state, "fuse", "v", "mnt") {
		t.Errorf("state %+v", st)
	}
	if err := s.Unstage(ctx, source.Volume{ID: "v", State: raw}); err != nil {
		t.Fatal(err)
	}
	last := f.stops[len(f.stops)-1]
	if !last.teardown || len(last.known) != 1 || last.known[0] != st.Daemon.Proc {
		t.Errorf("Unstage asked StopDaemons %+v", last)
	}
	if s.supervisorOf("v") != nil {
		t.Error("Unstage left a supervisor")
	}
}
