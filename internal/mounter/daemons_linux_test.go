//go:build linux

package mounter_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/testutil"
)

// daemonFixture is a node whose config has FUSE profiles over squashfs
// images in a directory of the test's: squashfuse (default capabilities),
// squashfuse-nocaps (none), squashfuse-user (runs as nobody), secretful
// (squashfuse with a secret, its path as the mount's fsname), sleeper (a
// "daemon" that never mounts) and leaky (prints its secret and fails).
type daemonFixture struct {
	t           *testing.T
	dir, state  string
	records     string
	images, img string
	outside     string
	cgroup      string // the node's DaemonCgroup ("": none)
	hostCgroup  string // the node's HostCgroupFS ("": none)
	cfg         *config.Config
	n           *mounter.Local
}

const nobody = 65534

const hogScript = `squashfuse -f -o allow_other "$1" "$2" &
until [ -e "$3/go" ]; do sleep 0.05; done
x=$(dd if=/dev/zero bs=1048576 count=256 2>/dev/null | tr '\0' a)
wait`

func newDaemonFixture(t *testing.T) *daemonFixture {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	testutil.NoLeaks(t)
	return daemonFixtureIn(t)
}

// daemonFixtureIn is newDaemonFixture without the leak check, for a test
// process whose parent checks (a child in a mount namespace of its own:
// the lock of testutil.NoLeaks is its parent's).
func daemonFixtureIn(t *testing.T) *daemonFixture {
	dir := mountnstest.Scratch(t)
	f := &daemonFixture{t: t, dir: dir, state: filepath.Join(dir, "state"), records: filepath.Join(dir, "records"),
		images: filepath.Join(dir, "images"), outside: filepath.Join(dir, "outside")}
	// A daemon of another user must reach its mount point and image.
	for d := dir; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{f.state, f.images, f.outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	content := filepath.Join(dir, "content")
	if err := os.Mkdir(content, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("from squashfs\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f.img = filepath.Join(f.images, "img.sqfs")
	mountnstest.Squashfs(t, content, f.img)
	if err := os.Chmod(f.img, 0o644); err != nil {
		t.Fatal(err)
	}
	src := fuseprofile.SourceRule{Roots: []string{f.images}}
	squash := []string{"-f", "{source}", "{mountpoint}", "-o", "allow_other"}
	// fd mode: the mounter mounts (allow_other is its option, not the
	// daemon's), the daemon serves /dev/fd/3.
	squashFd := []string{"-f", "{source}", "{mountpoint}"}
	other := []string{"allow_other"}
	limited := fuseprofile.Resources{Memory: "64Mi", CPU: "500m"}
	f.cfg = &config.Config{FuseProfiles: []fuseprofile.Profile{
		{Name: "squashfuse", Binary: "/usr/bin/squashfuse", Args: squash, Source: src, ReadyTimeout: fuseprofile.Duration{Duration: 10 * time.Second}},
		{Name: "squashfuse-nocaps", Binary: "/usr/bin/squashfuse", Args: squash, Source: src, Capabilities: []string{}},
		{Name: "squashfuse-user", Binary: "/usr/bin/squashfuse", Args: squash, Source: src, RunAs: &daemon.User{UID: nobody, GID: nobody}},
		// As root: a daemon that mounts by itself as another user needs
		// /dev/fuse open to all, which a node without udev does not give
		// (TestDaemonPrivilegesInMounter); the secrets work the same.
		{Name: "secretful", Binary: "/usr/bin/squashfuse", Args: append(squash, "-o", "fsname={secret:token}"), Source: src,
			Secrets: []fuseprofile.Secret{{Name: "token"}}},
		{Name: "squashfuse-fd", Binary: "/usr/bin/squashfuse", Args: squashFd, Source: src, FdMount: true, MountOptions: other},
		{Name: "squashfuse-user-fd", Binary: "/usr/bin/squashfuse", Args: squashFd, Source: src, RunAs: &daemon.User{UID: nobody, GID: nobody},
			FdMount: true, MountOptions: other},
		{Name: "secretful-fd", Binary: "/usr/bin/squashfuse", Args: append(squashFd, "-o", "fsname={secret:token}"), Source: src,
			Secrets: []fuseprofile.Secret{{Name: "token"}}, FdMount: true, MountOptions: other},
		{Name: "squashfuse-limited", Binary: "/usr/bin/squashfuse", Args: squashFd, Source: src, Resources: limited, FdMount: true, MountOptions: other},
		// sshfs of a directory of the test's, served by sftp-server
		// across the loopback network (directport: no sshd, no ssh). Not
		// an ssh_command script of the test's: the daemon's root holds no
		// test directory, as it holds nothing of a node but its volume's.
		{Name: "sshfs-fd", Binary: "/usr/bin/sshfs", Args: []string{"-f", "{source}", "{mountpoint}", "-o", "directport=" + sftpServer(t)},
			Source: fuseprofile.SourceRule{Pattern: `127\.0\.0\.1:/[A-Za-z0-9._/-]*`}, FdMount: true, MountOptions: []string{"allow_other", "default_permissions"}},
		// hog mounts (through squashfuse, its child) and, once told to
		// by a file in its work dir, reads 256 MiB into a variable of
		// its own: past its memory limit.
		{Name: "hog", Binary: "/bin/sh", Args: []string{"-c", hogScript, "hog", "{source}", "{mountpoint}", "{workdir}"}, Source: src,
			Resources: fuseprofile.Resources{Memory: "32Mi"}},
		{Name: "sleeper", Binary: "/bin/sh", Args: []string{"-c", "exec sleep 30", "{mountpoint}"}, Source: fuseprofile.SourceRule{Pattern: "x"}},
		// As root, as secretful is.
		{Name: "leaky", Binary: "/bin/sh", Args: []string{"-c", `cat "$1"; echo; echo giving up >&2; exit 3`, "{mountpoint}", "{secret:token}"},
			Source: fuseprofile.SourceRule{Pattern: "x"}, Secrets: []fuseprofile.Secret{{Name: "token"}}},
	}}
	if err := fuseprofile.Validate(f.cfg.FuseProfiles); err != nil {
		t.Fatal(err)
	}
	f.n = f.node()
	return f
}

// sftpData is the directory sshfs-fd serves, holding hello.txt.
func (f *daemonFixture) sftpData() string {
	d := filepath.Join(f.dir, "sftp-data")
	if err := os.MkdirAll(d, 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "hello.txt"), []byte("over sftp\n"), 0o644); err != nil {
		f.t.Fatal(err)
	}
	return d
}

// node makes a node over the fixture's state and records dirs (again,
// after a "restart").
func (f *daemonFixture) node() *mounter.Local {
	return node(f.t, mounter.Options{StateDir: f.state, KubeletDir: f.state, RecordsDir: f.records, Config: f.cfg, DaemonCgroup: f.cgroup, HostCgroupFS: f.hostCgroup})
}

func (f *daemonFixture) request(id, profile string) mounter.DaemonRequest {
	params := map[string]string{"profile": profile, "source": f.img}
	switch profile {
	case "sleeper", "leaky":
		params["source"] = "x"
	case "sshfs-fd":
		params["source"] = "127.0.0.1:" + f.sftpData()
	}
	return mounter.DaemonRequest{VolumeID: id, Profile: profile, Params: params, Generation: 1, ReadyTimeout: 10 * time.Second}
}

func (f *daemonFixture) volDir(id string) string { return filepath.Join(f.state, "fuse", id) }

// start starts id's daemon and registers its teardown.
func (f *daemonFixture) start(req mounter.DaemonRequest) mounter.DaemonInfo {
	f.t.Helper()
	info, err := f.n.StartDaemon(context.Background(), req)
	if err != nil {
		f.t.Fatalf("StartDaemon %s: %v", req.VolumeID, err)
	}
	f.t.Cleanup(func() { _ = f.n.StopDaemons(context.Background(), req.VolumeID, []daemon.Proc{info.Proc}, true) })
	return info
}

func (f *daemonFixture) stop(id string, teardown bool) {
	f.t.Helper()
	if err := f.n.StopDaemons(context.Background(), id, nil, teardown); err != nil {
		f.t.Fatalf("StopDaemons %s (teardown %t): %v", id, teardown, err)
	}
}

// gone checks that nothing of volume id is left: no directory, no mount,
// no record.
func (f *daemonFixture) gone(id string) {
	f.t.Helper()
	if _, err := os.Lstat(f.volDir(id)); err == nil {
		ents, _ := os.ReadDir(f.volDir(id))
		f.t.Errorf("%s is still there (%v)", f.volDir(id), ents)
	}
	for _, m := range mountnstest.MountsUnder(f.t, 0, f.volDir(id)) {
		f.t.Errorf("mount left: %s %s", m.FSType, m.Mountpoint)
	}
	if _, err := os.Stat(filepath.Join(f.records, "daemons", id+".json")); err == nil {
		f.t.Errorf("the mounter's record of %s is still there", id)
	}
}

// TestDaemonLifecycle: a daemon started through the node serves its
// mount, which a plan may then bind; the node watches it, also after it
// restarted itself; StopDaemons without teardown keeps the directory for
// the next generation, with teardown nothing is left. Both ways: the
// daemon mounts (squashfuse), the mounter mounts (squashfuse-fd).
func TestDaemonLifecycle(t *testing.T) {
	for _, profile := range []string{"squashfuse", "squashfuse-fd"} {
		t.Run(profile, func(t *testing.T) { daemonLifecycle(t, profile) })
	}
}

func daemonLifecycle(t *testing.T, profile string) {
	f := newDaemonFixture(t)
	ctx := context.Background()
	const id = "vol"
	info := f.start(f.request(id, profile))
	if !info.Alive() || info.Conn == 0 || info.BindSource != filepath.Join(f.volDir(id), "mnt") || info.MountPoint != info.BindSource {
		t.Fatalf("StartDaemon = %+v", info)
	}
	if b, err := os.ReadFile(filepath.Join(info.MountPoint, "hello.txt")); err != nil || string(b) != "from squashfs\n" {
		t.Fatalf("reading through the daemon's mount: %q, %v", b, err)
	}
	// The executor accepts a bind of the recorded mount (kubelet's publish
	// in the node's own namespace, below its kubelet dir).
	target := filepath.Join(f.state, "target")
	bind := []plan.Mount{{Type: plan.TypeBind, Source: info.BindSource, Options: []string{"nosuid", "nodev", "ro"}}}
	if err := f.n.Mount(ctx, bind, plan.Consumer{MountPoint: target}); err != nil {
		t.Fatalf("a bind of the daemon's mount: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(target, "hello.txt")); err != nil || string(b) != "from squashfs\n" {
		t.Errorf("reading through the bind: %q, %v", b, err)
	}
	if err := f.n.Unmount(ctx, bind, plan.Consumer{MountPoint: target}); err != nil {
		t.Fatal(err)
	}
	_ = os.Remove(target)
	if st, err := f.n.DaemonStatus(ctx, info.Proc, info.Conn); err != nil || !st.Alive || st.Waiting != 0 {
		t.Errorf("DaemonStatus = %+v, %v", st, err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err := f.n.WaitDaemon(short, info.Proc)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitDaemon of a live daemon = %v, want DeadlineExceeded", err)
	}

	// A restarted mounter takes the record back and watches the daemon,
	// which is not its child.
	f.n = f.node()
	if st, err := f.n.DaemonStatus(ctx, info.Proc, info.Conn); err != nil || !st.Alive {
		t.Errorf("DaemonStatus after a restart = %+v, %v", st, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- f.n.WaitDaemon(ctx, info.Proc) }()
	time.Sleep(50 * time.Millisecond)
	if err := syscall.Kill(info.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("WaitDaemon of a killed daemon = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WaitDaemon did not return within 5s of the daemon's kill")
	}

	// The supervisor's restart: stop without teardown, start generation 2.
	f.stop(id, false)
	if _, err := os.Stat(filepath.Join(f.volDir(id), "mnt")); err != nil {
		t.Errorf("StopDaemons without teardown removed the mount point: %v", err)
	}
	req := f.request(id, profile)
	req.Generation = 2
	second := f.start(req)
	if second.PID == info.PID || !second.Alive() || second.Conn == 0 {
		t.Errorf("generation 2: %+v (first %+v)", second, info)
	}
	if profile == "squashfuse-fd" {
		checkSandboxed(t, f, id, second.PID) // a restart's daemon too
	}
	if _, err := f.n.StartDaemon(ctx, req); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("StartDaemon while one runs = %v, want FailedPrecondition", err)
	}
	f.stop(id, true)
	if second.Alive() {
		t.Errorf("daemon %s runs on after teardown", second.Proc)
	}
	f.gone(id)
	if err := f.n.WaitDaemon(ctx, second.Proc); err != nil {
		t.Errorf("WaitDaemon of a stopped daemon = %v", err)
	}
	// Idempotent, also for a volume the node never knew.
	f.stop(id, true)
	f.stop("never-seen", true)
}

// TestDaemonSecrets: the secrets' tmpfs is the node's, its files hold the
// values (0600), a restart reads them back without being given them, and
// a failing daemon's log is quoted with them redacted. Both ways: the
// daemon mounts (secretful), the mounter mounts (secretful-fd).
func TestDaemonSecrets(t *testing.T) {
	for _, profile := range []string{"secretful", "secretful-fd"} {
		t.Run(profile, func(t *testing.T) { daemonSecrets(t, profile) })
	}
}

func daemonSecrets(t *testing.T, profile string) {
	f := newDaemonFixture(t)
	ctx := context.Background()
	const id, token = "secretful", "CANARY-t0ken-9c1d2e3f4a5b"
	req := f.request(id, profile)
	req.Secrets = map[string]string{"token": token}
	info := f.start(req)
	secrets := filepath.Join(f.volDir(id), "secrets")
	ms := mountnstest.MountsUnder(t, 0, secrets)
	if len(ms) != 1 || ms[0].FSType != "tmpfs" || !strings.Contains(ms[0].Options, "noexec") {
		t.Errorf("%s is not a tmpfs of its own: %+v", secrets, ms)
	}
	if fi, err := os.Stat(filepath.Join(secrets, "token")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("secret file: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(secrets, "token")); string(b) != token {
		t.Errorf("secret file holds %q", b)
	}
	if strings.Contains(strings.Join(info.Command.Args, " "), token) || strings.Contains(strings.Join(info.Command.Env, " "), token) {
		t.Error("the command holds the secret")
	}
	if strings.HasSuffix(profile, "-fd") {
		// In its sandbox the daemon finds its secrets at the same path,
		// read-only.
		checkSandboxed(t, f, id, info.PID)
		inRoot := fmt.Sprintf("/proc/%d/root%s", info.PID, filepath.Join(secrets, "token"))
		if b, err := os.ReadFile(inRoot); err != nil || string(b) != token {
			t.Errorf("the secret file in the daemon's root: %d bytes, %v; want the secret", len(b), err)
		}
		if w, err := os.OpenFile(inRoot, os.O_WRONLY, 0); !errors.Is(err, syscall.EROFS) {
			if err == nil {
				w.Close()
			}
			t.Errorf("opening the secret file for writing in the daemon's root = %v, want EROFS", err)
		}
	}
	// A restart takes no secrets; the files stay.
	f.stop(id, false)
	again := req
	again.Generation = 2
	if _, err := f.n.StartDaemon(ctx, again); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a restart given secrets again = %v, want InvalidArgument", err)
	}
	again.Secrets = nil
	f.start(again)
	if b, _ := os.ReadFile(filepath.Join(secrets, "token")); string(b) != token {
		t.Errorf("after the restart the secret file holds %q", b)
	}
	// A plan binds the volume's mount, never its secrets (they are the
	// mounter's, recorded, but not for binding: a plugin could otherwise
	// hand one volume's secrets to another's consumer).
	pid := mountnstest.Namespace(t, "private")
	target := filepath.Join(f.dir, "consumer")
	mkdirs(t, target)
	c := plan.Consumer{PID: pid, MountPoint: target}
	for _, src := range []string{secrets, filepath.Join(secrets, "token")} {
		err := f.n.Mount(ctx, []plan.Mount{{Type: plan.TypeBind, Source: src, Options: opts("ro")}}, c)
		if !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Errorf("a plan binding %s = %v, want PermissionDenied", src, err)
		}
		if got := mountedDev(t, pid, f.dir, target); got != 0 {
			t.Errorf("a refused bind of %s left a mount at the target", src)
		}
	}
	mnt := filepath.Join(f.volDir(id), "mnt")
	if err := f.n.Mount(ctx, []plan.Mount{{Type: plan.TypeBind, Source: mnt, Options: opts("ro")}}, c); err != nil {
		t.Errorf("a plan binding the volume's mount %s: %v", mnt, err)
	} else {
		undo(t, f.n, c)
	}
	f.stop(id, true)
	f.gone(id)

	// The daemon prints its secret and fails: redacted in the error, and
	// nothing is left.
	leaky := f.request("leaky", "leaky")
	leaky.Secrets = map[string]string{"token": token}
	leaky.ReadyTimeout = 5 * time.Second
	_, err := f.n.StartDaemon(ctx, leaky)
	if !errors.Is(err, errdefs.ErrUnavailable) || strings.Contains(err.Error(), token) || !strings.Contains(err.Error(), "[redacted]") || !strings.Contains(err.Error(), "giving up") {
		t.Errorf("StartDaemon of a daemon that prints its secret and fails = %v; want Unavailable quoting its log, redacted", err)
	}
	f.gone("leaky")
}

// TestDaemonPrivilegesInMounter (review finding 6c): the daemons the node
// starts run with no_new_privs and no capability beyond their profile's;
// one of another user mounts with its capability as an ambient one and
// owns its mount point; a profile without capabilities cannot mount, even
// through the setuid fusermount3, and leaves nothing.
func TestDaemonPrivilegesInMounter(t *testing.T) {
	f := newDaemonFixture(t)
	sysAdmin := daemon.CapabilityMask([]string{"SYS_ADMIN"})
	tests := []struct {
		profile string
		uid     string
		amb     uint64
	}{
		{"squashfuse", "0", 0},
		{"squashfuse-user", strconv.Itoa(nobody), sysAdmin},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			if tt.uid != "0" && !fuseOpenToAll(t) {
				// A node without udev (/dev/fuse 0600): a daemon of
				// another user that mounts by itself cannot, and is
				// refused before it runs, saying what to do.
				_, err := f.n.StartDaemon(context.Background(), f.request(tt.profile, tt.profile))
				if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "fdMount: true") {
					t.Errorf("StartDaemon of %s with /dev/fuse closed to its user = %v; want FailedPrecondition naming fdMount", tt.profile, err)
				}
				f.gone(tt.profile)
				return
			}
			info := f.start(f.request(tt.profile, tt.profile))
			st := mountnstest.ProcStatus(t, info.PID)
			if st["NoNewPrivs"] != "1" {
				t.Errorf("NoNewPrivs %q, want 1", st["NoNewPrivs"])
			}
			for _, field := range []string{"CapEff", "CapPrm", "CapBnd"} {
				if got := mountnstest.CapSet(t, st, field); got&^sysAdmin != 0 {
					t.Errorf("%s %016x holds more than the profile's SYS_ADMIN", field, got)
				}
			}
			if got := mountnstest.CapSet(t, st, "CapAmb"); got != tt.amb {
				t.Errorf("CapAmb %016x, want %016x", got, tt.amb)
			}
			if uid := strings.Fields(st["Uid"]); len(uid) == 0 || uid[0] != tt.uid {
				t.Errorf("Uid %q, want %s", st["Uid"], tt.uid)
			}
			if b, err := os.ReadFile(filepath.Join(info.MountPoint, "hello.txt")); err != nil || string(b) != "from squashfs\n" {
				t.Errorf("reading through the mount: %q, %v", b, err)
			}
			f.stop(tt.profile, true)
			f.gone(tt.profile)
		})
	}
	req := f.request("nocaps", "squashfuse-nocaps")
	req.ReadyTimeout = 3 * time.Second
	if _, err := f.n.StartDaemon(context.Background(), req); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("a daemon without capabilities = %v, want Unavailable (it cannot mount)", err)
	}
	f.gone("nocaps")
}

// fuseOpenToAll says whether /dev/fuse lets every user open it (udev's
// 0666), and logs which way the test runs.
func fuseOpenToAll(t *testing.T) bool {
	t.Helper()
	fi, err := os.Stat("/dev/fuse")
	if err != nil {
		t.Fatal(err)
	}
	open := fi.Mode().Perm()&0o006 == 0o006
	t.Logf("/dev/fuse is %s here: a daemon of another user that mounts by itself %s", fi.Mode(), map[bool]string{true: "can open it", false: "cannot open it"}[open])
	return open
}

// TestFuseDeviceOpenableBy: whom the mode of /dev/fuse lets a daemon that
// mounts by itself open it as, on any machine (a file of each mode stands
// in for the device); an fd-mode daemon and root are never refused.
func TestFuseDeviceOpenableBy(t *testing.T) {
	dir := t.TempDir()
	user := &daemon.User{UID: nobody, GID: nobody}
	own := &fuseprofile.Profile{Name: "own"}
	fd := &fuseprofile.Profile{Name: "fd", FdMount: true}
	for _, tt := range []struct {
		mode    os.FileMode
		prof    *fuseprofile.Profile
		runAs   *daemon.User
		refused bool
	}{
		{0o666, own, user, false},
		{0o600, own, user, true},
		{0o660, own, user, true},
		{0o600, own, nil, false},
		{0o600, own, &daemon.User{}, false},
		{0o600, fd, user, false},
	} {
		dev := filepath.Join(dir, fmt.Sprintf("fuse-%o", tt.mode))
		if err := os.WriteFile(dev, nil, tt.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dev, tt.mode); err != nil {
			t.Fatal(err)
		}
		err := mounter.FuseDeviceOpenableBy(dev, tt.prof, tt.runAs)
		if refused := errors.Is(err, errdefs.ErrFailedPrecondition); refused != tt.refused || (err != nil && !refused) {
			t.Errorf("mode %04o, profile %s, user %v: %v; want refused %v", tt.mode, tt.prof.Name, tt.runAs, err, tt.refused)
		}
	}
}

// TestDaemonHostile sends StartDaemon, StopDaemons, WaitDaemon and
// DaemonStatus what a compromised plugin could: each row ends with its
// sentinel, starts nothing, and follows no symlink it planted (the files
// outside are untouched).
func TestDaemonHostile(t *testing.T) {
	f := newDaemonFixture(t)
	ctx := context.Background()
	// The host's files outside the state dir: a key of the secret's name,
	// a big log of the log's name (a spawn would rotate it).
	hostKey := filepath.Join(f.outside, "token")
	if err := os.WriteFile(hostKey, []byte("host's key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	hostLog := filepath.Join(f.outside, "daemon.log")
	bigLog := bytes.Repeat([]byte("host's own file\n"), daemon.MaxLog/16+1)
	if err := os.WriteFile(hostLog, bigLog, 0o600); err != nil {
		t.Fatal(err)
	}
	plant := func(id string, links map[string]string, dirs ...string) func() {
		return func() {
			for _, d := range append([]string{f.volDir(id)}, dirs...) {
				if _, err := os.Lstat(d); err != nil && len(links) >= 0 {
					if _, ok := links[d]; !ok {
						if err := os.MkdirAll(d, 0o700); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			for link, to := range links {
				if err := os.MkdirAll(filepath.Dir(link), 0o700); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(to, link); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	secret := func(r mounter.DaemonRequest) mounter.DaemonRequest {
		r.Secrets = map[string]string{"token": "given"}
		return r
	}
	with := func(r mounter.DaemonRequest, fn func(*mounter.DaemonRequest)) mounter.DaemonRequest {
		fn(&r)
		return r
	}
	tests := []struct {
		name  string
		setup func()
		req   mounter.DaemonRequest
		want  error
	}{
		{"secrets dir a symlink to the host's keys (5a)", plant("s1", map[string]string{filepath.Join(f.volDir("s1"), "secrets"): f.outside}),
			secret(f.request("s1", "secretful")), errdefs.ErrPermissionDenied},
		{"volume dir a symlink", plant("", map[string]string{f.volDir("s2"): f.outside}),
			secret(f.request("s2", "secretful")), errdefs.ErrPermissionDenied},
		{"fuse dir a symlink", nil, f.request("s3", "squashfuse"), nil}, // set up below, last
		{"mount point a symlink", plant("s4", map[string]string{filepath.Join(f.volDir("s4"), "mnt"): f.outside}),
			f.request("s4", "squashfuse"), errdefs.ErrPermissionDenied},
		{"work dir a symlink", plant("s5", map[string]string{filepath.Join(f.volDir("s5"), "work"): f.outside}),
			f.request("s5", "squashfuse"), errdefs.ErrPermissionDenied},
		{"log a symlink to the host's file", plant("s6", map[string]string{filepath.Join(f.volDir("s6"), "daemon.log"): hostLog}),
			f.request("s6", "squashfuse"), errdefs.ErrPermissionDenied},
		{"unknown profile", nil, f.request("b1", "nfs"), errdefs.ErrInvalidArgument},
		{"option the profile lacks", nil, with(f.request("b2", "squashfuse"), func(r *mounter.DaemonRequest) { r.Params["debug"] = "1" }), errdefs.ErrInvalidArgument},
		{"source outside the profile's roots", nil, with(f.request("b3", "squashfuse"), func(r *mounter.DaemonRequest) { r.Params["source"] = hostKey }), errdefs.ErrInvalidArgument},
		{"secret the profile lacks", nil, secret(f.request("b4", "squashfuse")), errdefs.ErrInvalidArgument},
		{"required secret missing", nil, f.request("b5", "secretful"), errdefs.ErrInvalidArgument},
		{"secret too large", nil, with(f.request("b6", "secretful"), func(r *mounter.DaemonRequest) {
			r.Secrets = map[string]string{"token": strings.Repeat("x", 64<<10+1)}
		}), errdefs.ErrInvalidArgument},
		{"generation 0", nil, with(f.request("b7", "squashfuse"), func(r *mounter.DaemonRequest) { r.Generation = 0 }), errdefs.ErrInvalidArgument},
		{"volume id with a slash", nil, f.request("../b8", "squashfuse"), errdefs.ErrInvalidArgument},
		{"a restart whose secrets are gone", nil, with(f.request("b9", "secretful"), func(r *mounter.DaemonRequest) { r.Generation = 2 }), errdefs.ErrFailedPrecondition},
	}
	// The state dir's fuse/ itself a symlink: a node of its own.
	linkedState := filepath.Join(f.dir, "linked-state")
	if err := os.Mkdir(linkedState, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(f.outside, filepath.Join(linkedState, "fuse")); err != nil {
		t.Fatal(err)
	}
	linked := node(t, mounter.Options{StateDir: linkedState, KubeletDir: linkedState, RecordsDir: filepath.Join(f.dir, "records2"), Config: f.cfg})
	tests[2].setup, tests[2].want = nil, errdefs.ErrPermissionDenied
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.setup != nil {
				tt.setup()
			}
			n := f.n
			if i == 2 {
				n = linked
			}
			info, err := n.StartDaemon(ctx, tt.req)
			if err == nil {
				_ = n.StopDaemons(ctx, tt.req.VolumeID, []daemon.Proc{info.Proc}, true)
			}
			if !errors.Is(err, tt.want) {
				t.Errorf("StartDaemon = %v, want %v", err, tt.want)
			}
			if ms := mountnstest.MountsUnder(t, 0, f.dir); len(ms) > 0 {
				t.Errorf("the refused start left %d mounts, first %s", len(ms), ms[0].Mountpoint)
			}
		})
	}
	if b, err := os.ReadFile(hostKey); err != nil || string(b) != "host's key\n" {
		t.Errorf("the host's key: %q, %v", b, err)
	}
	if b, err := os.ReadFile(hostLog); err != nil || !bytes.Equal(b, bigLog) {
		t.Errorf("the host's log: %d bytes, %v", len(b), err)
	}
	if ents, _ := os.ReadDir(f.outside); len(ents) != 2 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("the host's directory now holds %q, want token and daemon.log only", names)
	}
	for _, id := range []string{"b1", "b2", "b3", "b4", "b5", "b6", "b7", "b9"} {
		if _, err := os.Lstat(f.volDir(id)); err == nil {
			t.Errorf("the refused start of %s made its directory", id)
		}
	}

	// A symlink file planted in a real secrets dir is shadowed by the
	// tmpfs: never followed, the secret lands in the tmpfs.
	plant("s7", map[string]string{filepath.Join(f.volDir("s7"), "secrets", "token"): hostKey})()
	f.start(secret(f.request("s7", "secretful")))
	if b, _ := os.ReadFile(filepath.Join(f.volDir("s7"), "secrets", "token")); string(b) != "given" {
		t.Errorf("the secret file holds %q", b)
	}
	if b, _ := os.ReadFile(hostKey); string(b) != "host's key\n" {
		t.Errorf("the host's key was written: %q", b)
	}
	f.stop("s7", true)

	// Daemons the node did not start are neither watched nor stopped.
	other := exec.Command("/bin/sleep", "30")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	p, err := daemon.Identify(other.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.n.WaitDaemon(ctx, p); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("WaitDaemon of a process the node did not start = %v, want NotFound", err)
	}
	if _, err := f.n.DaemonStatus(ctx, p, 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("DaemonStatus of a process the node did not start = %v, want NotFound", err)
	}
	info := f.start(f.request("s8", "squashfuse"))
	if err := f.n.StopDaemons(ctx, "s8", []daemon.Proc{p, p, p, p, p, p, p, p, p, p, p, p, p, p, p, p, p}, true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("StopDaemons naming 17 daemons = %v, want InvalidArgument", err)
	}
	if _, err := f.n.DaemonStatus(ctx, info.Proc, info.Conn+1); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("DaemonStatus of another connection = %v, want InvalidArgument", err)
	}
	if err := f.n.StopDaemons(ctx, "s8", []daemon.Proc{p}, true); err != nil {
		t.Fatal(err)
	}
	if !p.Alive() {
		t.Error("StopDaemons killed a process the caller named that is no daemon of the volume")
	}
	if info.Alive() {
		t.Error("StopDaemons left the volume's daemon running")
	}
	f.gone("s8")

	// A bounded number of volumes.
	restore := mounter.SetMaxDaemonVolumes(1)
	defer restore()
	f.start(f.request("one", "squashfuse"))
	if _, err := f.n.StartDaemon(ctx, f.request("two", "squashfuse")); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("StartDaemon past the bound = %v, want ResourceExhausted", err)
	}
	f.stop("one", true)
	f.gone("two")

	// A node without profiles starts nothing.
	bare := node(t, mounter.Options{StateDir: f.state, KubeletDir: f.state, RecordsDir: filepath.Join(f.dir, "records3")})
	if _, err := bare.StartDaemon(ctx, f.request("none", "squashfuse")); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("StartDaemon without profiles = %v, want FailedPrecondition", err)
	}
	// Nor does one that only observes another's records.
	observer := node(t, mounter.Options{StateDir: f.state, KubeletDir: f.state, RecordsDir: f.records, Config: f.cfg, Observe: true})
	if _, err := observer.StartDaemon(ctx, f.request("obs", "squashfuse")); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("StartDaemon of an observer = %v, want FailedPrecondition", err)
	}
}

// TestDaemonTreeAgainstPlugin: the daemons are given the paths of their
// volume's directory as strings, so the plugin (root without a
// capability, the owner of what it makes in the state dir) must not be
// able to swap any directory on the way for one of its own or a symlink
// between the node's checks and the daemon's use. As such a process: the
// FUSE tree cannot be renamed, removed or written, the mounter's records
// cannot be read or written; the plugin's own entries in the state dir
// still can be made, renamed and removed.
func TestDaemonTreeAgainstPlugin(t *testing.T) {
	f := newDaemonFixture(t)
	mountnstest.RequireTool(t, "setpriv")
	const id = "treevol"
	f.start(f.request(id, "squashfuse"))
	asPlugin := func(script string) error {
		cmd := exec.Command("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--", "sh", "-euc", script)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	fuse, vol := filepath.Join(f.state, "fuse"), f.volDir(id)
	for _, tt := range []struct{ name, script string }{
		{"rename the FUSE tree", "mv " + fuse + " " + fuse + ".old"},
		{"remove the FUSE tree", "rm -rf " + fuse},
		{"plant in the FUSE tree", "ln -s /etc " + fuse + "/planted"},
		{"rename a volume's directory", "mv " + vol + " " + fuse + "/moved"},
		{"rename a volume's mount point", "mv " + vol + "/mnt " + vol + "/mnt.old"},
		{"rename a volume's work dir", "mv " + vol + "/work " + vol + "/work.old"},
		{"plant in a volume's directory", "ln -s /etc " + vol + "/daemon.log.1"},
		{"list the mounter's records", "ls " + f.records},
		{"forge a record", "echo '{}' > " + f.records + "/forged.json"},
	} {
		if err := asPlugin(tt.script); err == nil {
			t.Errorf("as the plugin, %s (%s): allowed", tt.name, tt.script)
		}
	}
	if _, err := os.Stat(filepath.Join(vol, "mnt", "hello.txt")); err != nil {
		t.Errorf("the volume's mount after the attempts: %v", err)
	}
	// The plugin's own work in the state dir goes on.
	mine := filepath.Join(f.state, "volumes")
	if err := asPlugin("mkdir -p " + mine + " && echo x > " + mine + "/v.json && mv " + mine + "/v.json " + mine + "/w.json && rm " + mine + "/w.json && mv " + mine + " " + mine + ".2 && rmdir " + mine + ".2"); err != nil {
		t.Errorf("as the plugin, its own entries in the state dir: %v", err)
	}
	f.stop(id, true)
	f.gone(id)
}
