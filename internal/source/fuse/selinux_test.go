package fuse

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/mountplan/mountplan/internal/source"
)

// TestStageLabelsTheDaemonsMount: the stage's SELinux label goes to the
// mounter with the daemon's start (the mounter labels the FUSE mount it
// makes in fd mode) and into the state, for every restart's mount.
func TestStageLabelsTheDaemonsMount(t *testing.T) {
	f := &fakeDaemons{}
	s, err := New(Options{StateDir: t.TempDir(), Profiles: exampleProfiles(t), Daemons: f})
	if err != nil {
		t.Fatal(err)
	}
	defer s.stop()
	const label = "system_u:object_r:container_file_t:s0:c1,c2"
	raw, err := s.Stage(context.Background(), source.Volume{ID: "v", Parameters: map[string]string{"profile": "sshfs", "source": "me@example.org:/srv"}},
		source.StageRequest{Secrets: map[string]string{"sshKey": "k", "knownHosts": "h"}, SELinuxContext: label})
	if err != nil {
		t.Fatal(err)
	}
	if len(f.starts) != 1 || f.starts[0].SELinuxContext != label {
		t.Fatalf("StartDaemon requests %+v: want the label %q", f.starts, label)
	}
	var st State
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	if st.SELinuxContext != label {
		t.Fatalf("the state's label %q, want %q", st.SELinuxContext, label)
	}
}
