package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/internal/source"
)

// After a reboot a volume staged with secrets has neither its daemon's
// mount nor its secrets' tmpfs: Adopt asks for a new stage (the driver
// stages again with kubelet's request, which carries the secrets) instead
// of supervising a daemon that can never start again. A volume whose
// daemon still serves, or whose secrets' tmpfs is still there (the
// mounter restarted, not the node), is supervised as before.
func TestAdoptAfterRebootNeedsTheSecrets(t *testing.T) {
	for name, tt := range map[string]struct {
		secrets, serving, tmpfs bool
		needsStage              bool
	}{
		"rebooted, with secrets":       {secrets: true, needsStage: true},
		"rebooted, without secrets":    {},
		"daemon still serving":         {secrets: true, serving: true},
		"secrets' tmpfs still mounted": {secrets: true, tmpfs: true},
		"both still there, no secrets": {serving: true, tmpfs: true},
	} {
		t.Run(name, func(t *testing.T) {
			state := t.TempDir()
			s, err := New(Options{StateDir: state, Profiles: exampleProfiles(t), Daemons: &fakeDaemons{}})
			if err != nil {
				t.Fatal(err)
			}
			defer s.stop()
			dir := filepath.Join(state, "fuse", "v")
			if err := os.MkdirAll(filepath.Join(dir, "secrets"), 0o700); err != nil {
				t.Fatal(err)
			}
			s.fuseAt = func(p string) (*mountinfo.Info, error) {
				if tt.serving && p == filepath.Join(dir, "mnt") {
					return &mountinfo.Info{Mountpoint: p, FSType: "fuse.sshfs"}, nil
				}
				return nil, nil
			}
			s.mounted = func(p string) (bool, error) { return tt.tmpfs && p == filepath.Join(dir, "secrets"), nil }
			st, _ := json.Marshal(State{Profile: "sshfs", MountPoint: filepath.Join(dir, "mnt"), BindSource: filepath.Join(dir, "mnt"), Secrets: tt.secrets,
				Daemon: Daemon{Generation: 1, Conn: 77}})
			_, err = s.Adopt(context.Background(), source.Volume{ID: "v", Staging: true, State: st,
				Parameters: map[string]string{"profile": "sshfs", "source": "me@example.org:/srv"}})
			if got := errors.Is(err, source.ErrNeedsStage); got != tt.needsStage {
				t.Fatalf("Adopt = %v, want ErrNeedsStage %v", err, tt.needsStage)
			}
			if supervised := s.supervisorOf("v") != nil; supervised == tt.needsStage {
				t.Errorf("supervised %v after Adopt = %v", supervised, err)
			}
		})
	}
}
