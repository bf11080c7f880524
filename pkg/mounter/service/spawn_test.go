package service_test

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/daemon/policy"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fuseprofile"
	"github.com/mountplan/mountplan/pkg/mounter/service"
)

// fakeSpawner records the commands it is asked to start.
type fakeSpawner struct {
	mu   sync.Mutex
	got  []daemon.Command
	proc daemon.Proc
	err  error
}

func (f *fakeSpawner) Spawn(_ context.Context, c daemon.Command) (daemon.Proc, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, c)
	return f.proc, f.err
}

// serveDaemons runs the Mounter service with a daemon policy and returns
// the client spawner and the raw client.
func serveDaemons(t *testing.T, p *policy.Policy) (daemon.Spawner, api.MounterClient) {
	conn := serveConn(t, &recorder{}, service.WithDaemons(p))
	return service.NewSpawner(conn), api.NewMounterClient(conn)
}

// spawnEnv is a state dir with one volume's directories, a directory
// outside it, and a policy with an sshfs-like and a squashfuse-like profile.
type spawnEnv struct {
	root, outside, vol string
	fake               *fakeSpawner
	policy             *policy.Policy
}

func newSpawnEnv(t *testing.T) *spawnEnv {
	e := &spawnEnv{root: t.TempDir(), outside: t.TempDir()}
	e.vol = filepath.Join(e.root, "fuse", "vol")
	images := filepath.Join(e.root, "images")
	for _, d := range []string{filepath.Join(e.vol, "mnt"), filepath.Join(e.vol, "work"), filepath.Join(e.vol, "secrets"), images} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(images, "a.sqfs"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// Below the root, leading outside it.
	if err := os.Symlink(e.outside, filepath.Join(e.root, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(e.vol, "mnt-link")); err != nil {
		t.Fatal(err)
	}
	e.fake = &fakeSpawner{proc: daemon.Proc{PID: 4242, StartTime: 99}}
	e.policy = &policy.Policy{Roots: []string{e.root}, Spawner: e.fake, Profiles: []fuseprofile.Profile{
		{Name: "sshfs", Binary: "/usr/bin/sshfs", Args: []string{"-f", "{source}", "{mountpoint}", "-o", "IdentityFile={secret:key}", "{options}"},
			Source:  fuseprofile.SourceRule{Pattern: `[a-z]+@[a-z.]+:/[a-z/]*`},
			Options: []fuseprofile.Option{{Name: "port", Pattern: "[0-9]{1,5}", Args: []string{"-p", "{value}"}}},
			Secrets: []fuseprofile.Secret{{Name: "key"}}, RunAs: &daemon.User{UID: 1000, GID: 1000}},
		{Name: "squashfuse", Binary: "/usr/bin/squashfuse", Args: []string{"-f", "{source}", "{mountpoint}"},
			Source: fuseprofile.SourceRule{Roots: []string{images}}},
	}}
	return e
}

// request is a valid SpawnDaemon request for the sshfs profile.
func (e *spawnEnv) request() *api.SpawnDaemonRequest {
	return &api.SpawnDaemonRequest{
		Profile: "sshfs", Parameters: map[string]string{"profile": "sshfs", "source": "me@example.org:/srv", "port": "2222"},
		Secrets: []string{"key"},
		Paths: &api.DaemonPaths{MountPoint: filepath.Join(e.vol, "mnt"), WorkDir: filepath.Join(e.vol, "work"),
			SecretsDir: filepath.Join(e.vol, "secrets"), Log: filepath.Join(e.vol, "daemon.log")},
	}
}

func TestSpawnDaemonRendersFromItsProfile(t *testing.T) {
	e := newSpawnEnv(t)
	sp, _ := serveDaemons(t, e.policy)
	spec := service.SpecFromProto(e.request())
	// What the plugin rendered does not matter: only its spec travels.
	sent := daemon.Command{Path: "/bin/sh", Args: []string{"-c", "id"}, Env: []string{"LD_PRELOAD=/tmp/x.so"}, Spec: &spec}
	p, err := sp.Spawn(context.Background(), sent)
	if err != nil {
		t.Fatal(err)
	}
	if p != e.fake.proc {
		t.Errorf("Spawn returned %+v, want %+v", p, e.fake.proc)
	}
	want := daemon.Command{Path: "/usr/bin/sshfs",
		Args: []string{"-f", "me@example.org:/srv", filepath.Join(e.vol, "mnt"), "-o", "IdentityFile=" + filepath.Join(e.vol, "secrets", "key"), "-p", "2222"},
		Env:  []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Log:  filepath.Join(e.vol, "daemon.log"), RunAs: &daemon.User{UID: 1000, GID: 1000}}
	if len(e.fake.got) != 1 {
		t.Fatalf("spawner got %d commands", len(e.fake.got))
	}
	got := e.fake.got[0]
	got.Spec = nil
	if !reflect.DeepEqual(got, want) {
		t.Errorf("the spawner got\n%+v\nwant\n%+v", got, want)
	}
	// A command without a spec (a record of an older plugin) is not sent.
	if _, err := sp.Spawn(context.Background(), daemon.Command{Path: "/usr/bin/sshfs"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("command without spec: %v, want FailedPrecondition", err)
	}
}

// TestSpawnDaemonHostile sends what a compromised plugin could: each row is
// a request and the code the mounter answers, and none reaches the spawner.
func TestSpawnDaemonHostile(t *testing.T) {
	e := newSpawnEnv(t)
	_, raw := serveDaemons(t, e.policy)
	with := func(f func(r *api.SpawnDaemonRequest)) *api.SpawnDaemonRequest {
		r := e.request()
		r.Parameters = maps.Clone(r.Parameters)
		f(r)
		return r
	}
	squash := func(source string) func(r *api.SpawnDaemonRequest) {
		return func(r *api.SpawnDaemonRequest) {
			r.Profile, r.Secrets = "squashfuse", nil
			r.Parameters = map[string]string{"profile": "squashfuse", "source": source}
		}
	}
	tests := []struct {
		name string
		req  *api.SpawnDaemonRequest
		want codes.Code
	}{
		{"empty request", &api.SpawnDaemonRequest{}, codes.InvalidArgument},
		{"profile not in the mounter's config", with(func(r *api.SpawnDaemonRequest) { r.Profile = "bash" }), codes.InvalidArgument},
		{"parameters of another profile", with(func(r *api.SpawnDaemonRequest) { r.Parameters["profile"] = "squashfuse" }), codes.InvalidArgument},
		{"ssh_command as an option", with(func(r *api.SpawnDaemonRequest) { r.Parameters["ssh_command"] = "/tmp/x" }), codes.InvalidArgument},
		{"option value adding -o ssh_command", with(func(r *api.SpawnDaemonRequest) { r.Parameters["port"] = "22,ssh_command=/tmp/x" }), codes.InvalidArgument},
		{"source adding an argument", with(func(r *api.SpawnDaemonRequest) { r.Parameters["source"] = "-oProxyCommand=/tmp/x" }), codes.InvalidArgument},
		{"source with a shell", with(func(r *api.SpawnDaemonRequest) { r.Parameters["source"] = "a@b:/c;id" }), codes.InvalidArgument},
		{"source of another shape", with(func(r *api.SpawnDaemonRequest) { r.Parameters["source"] = "/etc" }), codes.InvalidArgument},
		{"required secret missing", with(func(r *api.SpawnDaemonRequest) { r.Secrets = nil }), codes.InvalidArgument},
		{"secret the profile lacks", with(func(r *api.SpawnDaemonRequest) { r.Secrets = append(r.Secrets, "token") }), codes.InvalidArgument},
		{"secrets dir adding -o options", with(func(r *api.SpawnDaemonRequest) { r.Paths.SecretsDir = e.vol + "/s,ssh_command=/tmp/x" }), codes.InvalidArgument},
		{"no paths", with(func(r *api.SpawnDaemonRequest) { r.Paths = nil }), codes.InvalidArgument},
		{"mount point outside the roots", with(func(r *api.SpawnDaemonRequest) { r.Paths.MountPoint = "/etc" }), codes.PermissionDenied},
		{"mount point a symlink to /etc", with(func(r *api.SpawnDaemonRequest) { r.Paths.MountPoint = filepath.Join(e.vol, "mnt-link") }), codes.PermissionDenied},
		{"work dir through a symlink out", with(func(r *api.SpawnDaemonRequest) { r.Paths.WorkDir = filepath.Join(e.root, "escape", "w") }), codes.PermissionDenied},
		{"log outside the roots", with(func(r *api.SpawnDaemonRequest) { r.Paths.Log = filepath.Join(e.outside, "log") }), codes.PermissionDenied},
		{"log through a symlink out", with(func(r *api.SpawnDaemonRequest) { r.Paths.Log = filepath.Join(e.root, "escape", "log") }), codes.PermissionDenied},
		{"secrets dir at /etc", with(func(r *api.SpawnDaemonRequest) { r.Paths.SecretsDir = "/etc" }), codes.PermissionDenied},
		{"unclean log", with(func(r *api.SpawnDaemonRequest) { r.Paths.Log = e.root + "/fuse/../../x/log" }), codes.InvalidArgument},
		{"image outside the profile's roots", with(squash("/etc/shadow")), codes.InvalidArgument},
		{"image through ..", with(squash(e.root + "/images/../../etc/shadow")), codes.InvalidArgument},
		{"image that does not exist", with(squash(e.root + "/images/none.sqfs")), codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := raw.SpawnDaemon(context.Background(), tt.req)
			if status.Code(err) != tt.want {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
	if len(e.fake.got) != 0 {
		t.Errorf("refused requests reached the spawner: %+v", e.fake.got)
	}
	// The control: the same request unchanged is started.
	if _, err := raw.SpawnDaemon(context.Background(), with(squash(e.root+"/images/a.sqfs"))); err != nil {
		t.Fatalf("an allowed request: %v", err)
	}
	// A spawner's error comes back with its message.
	e.fake.err = errors.New("exec failed")
	if _, err := raw.SpawnDaemon(context.Background(), e.request()); err == nil || !strings.Contains(err.Error(), "exec failed") {
		t.Errorf("a spawner's failure: %v", err)
	}
}

func TestSpawnDaemonWithoutPolicy(t *testing.T) {
	for name, p := range map[string]*policy.Policy{
		"no policy":   nil,
		"no profiles": policy.For(nil, []string{"/var/lib/mountplan"}),
	} {
		_, raw := serveDaemons(t, p)
		_, err := raw.SpawnDaemon(context.Background(), &api.SpawnDaemonRequest{Profile: "sshfs"})
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("%s: the wire code is %v, want FailedPrecondition", name, status.Code(err))
		}
	}
}

// TestSpawnDaemonLocal starts a real daemon through the service with
// daemon.LocalSpawner: it becomes the server's child in its own session.
func TestSpawnDaemonLocal(t *testing.T) {
	e := newSpawnEnv(t)
	e.policy.Spawner = nil
	e.policy.Profiles = []fuseprofile.Profile{{Name: "sleeper", Binary: "/bin/sh", Args: []string{"-c", "exec sleep 30", "{mountpoint}"},
		Source: fuseprofile.SourceRule{Pattern: "x"}}}
	sp, _ := serveDaemons(t, e.policy)
	req := e.request()
	spec := service.SpecFromProto(req)
	spec.Profile, spec.Params, spec.Secrets = "sleeper", map[string]string{"profile": "sleeper", "source": "x"}, nil
	p, err := sp.Spawn(context.Background(), daemon.Command{Spec: &spec})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = killProc(p) }()
	if !p.Alive() {
		t.Fatalf("daemon %s is not running", p)
	}
	if st, ok := daemon.ReadStat(p.PID); !ok || st.Session != p.PID {
		t.Errorf("daemon %s runs in session %d, want its own", p, st.Session)
	}
}

func killProc(p daemon.Proc) error {
	proc, err := os.FindProcess(p.PID)
	if err != nil {
		return err
	}
	return proc.Kill()
}
