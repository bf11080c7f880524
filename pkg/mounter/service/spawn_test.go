package service_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/daemon/policy"
	"github.com/mountplan/mountplan/pkg/errdefs"
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

func TestSpawnDaemonPolicy(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	vol := filepath.Join(root, "fuse", "vol")
	if err := os.MkdirAll(vol, 0o700); err != nil {
		t.Fatal(err)
	}
	// A directory below the root that leads outside it.
	if err := os.Symlink(outside, filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	fake := &fakeSpawner{proc: daemon.Proc{PID: 4242, StartTime: 99}}
	pol := &policy.Policy{
		Allowed: []policy.Daemon{{Path: "/usr/bin/squashfuse"}, {Path: "/usr/bin/rclone", RunAs: &daemon.User{UID: 1000, GID: 1000}}},
		Roots:   []string{root},
		Spawner: fake,
	}
	sp, _ := serveDaemons(t, pol)
	log := filepath.Join(vol, "daemon.log")
	good := daemon.Command{Path: "/usr/bin/squashfuse", Args: []string{"-f", "/img", filepath.Join(vol, "mnt")},
		Env: []string{"PATH=/usr/bin:/bin"}, Stdin: filepath.Join(vol, "secret"), Log: log}
	ctx := context.Background()
	p, err := sp.Spawn(ctx, good)
	if err != nil {
		t.Fatalf("an allowed daemon: %v", err)
	}
	if p != fake.proc {
		t.Errorf("Spawn returned %+v, want %+v", p, fake.proc)
	}
	if len(fake.got) != 1 || !reflect.DeepEqual(fake.got[0], good) {
		t.Errorf("the spawner got %+v, want %+v", fake.got, good)
	}
	asUser := daemon.Command{Path: "/usr/bin/rclone", Log: log, RunAs: &daemon.User{UID: 1000, GID: 1000}}
	if _, err := sp.Spawn(ctx, asUser); err != nil {
		t.Errorf("an allowed daemon with its profile's user: %v", err)
	} else if got := fake.got[len(fake.got)-1]; !reflect.DeepEqual(got.RunAs, asUser.RunAs) {
		t.Errorf("runAs arrived as %+v", got.RunAs)
	}

	with := func(f func(c *daemon.Command)) daemon.Command {
		c := good
		c.Args = slices.Clone(good.Args)
		f(&c)
		return c
	}
	bad := map[string]daemon.Command{
		"binary of no profile":    with(func(c *daemon.Command) { c.Path = "/bin/sh" }),
		"relative binary":         with(func(c *daemon.Command) { c.Path = "usr/bin/squashfuse" }),
		"unclean binary":          with(func(c *daemon.Command) { c.Path = "/usr/bin/../bin/squashfuse" }),
		"user of no profile":      with(func(c *daemon.Command) { c.RunAs = &daemon.User{UID: 1000, GID: 1000} }),
		"root for a user profile": with(func(c *daemon.Command) { c.Path = "/usr/bin/rclone" }),
		"log outside the roots":   with(func(c *daemon.Command) { c.Log = filepath.Join(outside, "log") }),
		"no log":                  with(func(c *daemon.Command) { c.Log = "" }),
		"relative log":            with(func(c *daemon.Command) { c.Log = "daemon.log" }),
		"unclean log":             with(func(c *daemon.Command) { c.Log = root + "/fuse/../../x/log" }),
		"log through a symlink":   with(func(c *daemon.Command) { c.Log = filepath.Join(root, "escape", "log") }),
		"stdin outside the roots": with(func(c *daemon.Command) { c.Stdin = "/etc/shadow" }),
		"stdin in a missing dir":  with(func(c *daemon.Command) { c.Stdin = filepath.Join(root, "nowhere", "secret") }),
		"environment not K=V":     with(func(c *daemon.Command) { c.Env = []string{"NOEQUALS"} }),
		"NUL in an argument":      with(func(c *daemon.Command) { c.Args[0] = "a\x00b" }),
	}
	n := len(fake.got)
	for name, c := range bad {
		_, err := sp.Spawn(ctx, c)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: got %v, want InvalidArgument", name, err)
		}
	}
	if len(fake.got) != n {
		t.Errorf("refused commands reached the spawner: %+v", fake.got[n:])
	}

	// A spawner's error comes back with its code.
	fake.err = errors.New("exec failed")
	if _, err := sp.Spawn(ctx, good); err == nil || !strings.Contains(err.Error(), "exec failed") {
		t.Errorf("a spawner's failure: %v", err)
	}
}

func TestSpawnDaemonWithoutPolicy(t *testing.T) {
	for name, p := range map[string]*policy.Policy{
		"no policy":   nil,
		"no profiles": policy.For(&config.Config{}, []string{"/var/lib/mountplan"}),
	} {
		sp, raw := serveDaemons(t, p)
		_, err := sp.Spawn(context.Background(), daemon.Command{Path: "/usr/bin/squashfuse", Log: "/var/lib/mountplan/log"})
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("%s: got %v, want FailedPrecondition", name, err)
		}
		_, err = raw.SpawnDaemon(context.Background(), &api.SpawnDaemonRequest{Path: "/usr/bin/squashfuse"})
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("%s: the wire code is %v, want FailedPrecondition", name, status.Code(err))
		}
	}
}

// TestSpawnDaemonLocal starts a real daemon through the service with
// daemon.LocalSpawner: it becomes the server's child in its own session.
func TestSpawnDaemonLocal(t *testing.T) {
	root := t.TempDir()
	sp, _ := serveDaemons(t, &policy.Policy{Allowed: []policy.Daemon{{Path: "/bin/sh"}}, Roots: []string{root}})
	log := filepath.Join(root, "daemon.log")
	p, err := sp.Spawn(context.Background(), daemon.Command{Path: "/bin/sh", Args: []string{"-c", "echo started; exec sleep 30"}, Log: log})
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
