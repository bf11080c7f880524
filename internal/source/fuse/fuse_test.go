package fuse

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
)

func exampleProfiles(t *testing.T) []fuseprofile.Profile {
	t.Helper()
	c, err := config.Load(filepath.Join("testdata", "profiles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return c.FuseProfiles
}

func TestNewVolumeChecksContext(t *testing.T) {
	s, err := New(Options{StateDir: t.TempDir(), Profiles: exampleProfiles(t)})
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.NewVolume("v1", map[string]string{"type": "fuse", "profile": "sshfs", "source": "me@example.org:/srv",
		"port": "2222", "csi.storage.k8s.io/pod.name": "ignored"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"profile": "sshfs", "source": "me@example.org:/srv", "port": "2222"}
	if v.ID != "v1" || v.Kind != model.KindStatic || !mapsEqual(v.Parameters, want) {
		t.Errorf("volume %+v, want parameters %v", v, want)
	}
	for name, vctx := range map[string]map[string]string{
		"unknown profile":  {"profile": "nfs", "source": "a@b:/c"},
		"no profile":       {"source": "a@b:/c"},
		"no source":        {"profile": "sshfs"},
		"unknown option":   {"profile": "sshfs", "source": "a@b:/c", "ssh_command": "sh"},
		"bad option value": {"profile": "sshfs", "source": "a@b:/c", "port": "22;id"},
		"metacharacters":   {"profile": "sshfs", "source": "a@b:/c;id"},
		"not the pattern":  {"profile": "sshfs", "source": "/etc/passwd"},
		"relative path":    {"profile": "squashfuse", "source": "images/a.sqfs"},
		"dotdot path":      {"profile": "squashfuse", "source": "/srv/squashfs/../../etc"},
	} {
		if _, err := s.NewVolume("v", vctx); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: got %v, want InvalidArgument", name, err)
		}
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestCheckSecrets(t *testing.T) {
	p := &fuseprofile.Profile{Name: "t", Secrets: []fuseprofile.Secret{{Name: "key"}, {Name: "pass", Optional: true}}}
	const canary = "CANARY-in-a-secret"
	if err := checkSecrets(p, map[string]string{"key": canary}); err != nil {
		t.Errorf("checkSecrets: %v", err)
	}
	for name, secrets := range map[string]map[string]string{
		"missing":  {"pass": canary},
		"unknown":  {"key": canary, "token": canary},
		"too long": {"key": strings.Repeat("x", maxSecret+1)},
	} {
		err := checkSecrets(p, secrets)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: got %v, want InvalidArgument", name, err)
		}
		if err != nil && strings.Contains(err.Error(), canary) {
			t.Errorf("%s: the error holds the secret: %v", name, err)
		}
	}
}

func TestBackoff(t *testing.T) {
	if backoff(0) != 0 || backoff(1) != backoffBase || backoff(2) != 2*backoffBase || backoff(100) != backoffMax {
		t.Errorf("backoff: %v %v %v %v", backoff(0), backoff(1), backoff(2), backoff(100))
	}
}

func TestPlan(t *testing.T) {
	s, err := New(Options{StateDir: "/var/lib/mountplan"})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := json.Marshal(State{BindSource: "/var/lib/mountplan/fuse/v/mnt", MountPoint: "/var/lib/mountplan/fuse/v/mnt"})
	v := source.Volume{ID: "v", Staging: true, State: st}
	// No daemon's mount at the mount point (a reboot, a daemon being
	// restarted): no plan, rather than a bind of the empty directory.
	s.fuseAt = func(string) (*mountinfo.Info, error) { return nil, nil }
	if _, err := s.Plan(v, source.PlanRequest{}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("plan without the daemon's mount: got %v, want Unavailable", err)
	}
	s.fuseAt = func(p string) (*mountinfo.Info, error) {
		return &mountinfo.Info{Mountpoint: p, FSType: "fuse.squashfuse"}, nil
	}
	got, err := s.Plan(v, source.PlanRequest{ReadOnly: true, MountFlags: []string{"noexec"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Type != "bind" || got[0].Source != "/var/lib/mountplan/fuse/v/mnt" ||
		!slices.Equal(got[0].Options, []string{"nosuid", "nodev", "ro", "noexec"}) {
		t.Errorf("plan %v", got)
	}
	for _, req := range []source.PlanRequest{{Block: true}, {MountFlags: []string{"uid=0"}}} {
		if _, err := s.Plan(v, req); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("plan %+v: got %v, want InvalidArgument", req, err)
		}
	}
}
