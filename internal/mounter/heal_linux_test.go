//go:build linux

package mounter_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
)

// healFixture is a state dir with a FUSE volume's mount point
// (<state>/fuse/vol/mnt), a kubelet dir, and squashfs images whose daemons
// can be killed and restarted on that mount point.
type healFixture struct {
	t              *testing.T
	dir, state     string
	kubelet, src   string
	img, imgLinked string // sub/ a directory; sub a symlink to /
	e              *mounter.Local
	daemon         *exec.Cmd
}

func newHealFixture(t *testing.T) *healFixture {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	dir := mountnstest.Scratch(t)
	f := &healFixture{t: t, dir: dir, state: filepath.Join(dir, "state"), kubelet: filepath.Join(dir, "kubelet")}
	f.src = filepath.Join(f.state, "fuse", "vol", "mnt")
	for _, d := range []string{f.src, f.kubelet} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	f.img = f.image("img", false)
	f.imgLinked = f.image("linked", true)
	f.e = node(t, mounter.Options{StateDir: f.state, KubeletDir: f.kubelet})
	return f
}

// startDaemon starts squashfuse of img at mnt and records its mount as the
// mounter's StartDaemon does.
func (f *healFixture) startDaemon(img, mnt string) *exec.Cmd {
	cmd := startSquashfuse(f.t, img, mnt)
	if err := mounter.RecordMount(f.e, "fuse", mnt); err != nil {
		f.t.Fatal(err)
	}
	return cmd
}

// image makes a squashfs image holding f ("hello") and sub/g ("below"), or
// with sub a symlink to / when linked.
func (f *healFixture) image(name string, linked bool) string {
	content := filepath.Join(f.dir, name+"-content")
	files := map[string]string{"f": "hello\n", "sub/g": "below\n"}
	if linked {
		files = map[string]string{"f": "hello\n"}
	}
	for p, data := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(content, p)), 0o750); err != nil {
			f.t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(content, p), []byte(data), 0o644); err != nil {
			f.t.Fatal(err)
		}
	}
	if linked {
		if err := os.Symlink("/", filepath.Join(content, "sub")); err != nil {
			f.t.Fatal(err)
		}
	}
	img := filepath.Join(f.dir, name+".sqfs")
	mountnstest.Squashfs(f.t, content, img)
	return img
}

// restart kills the daemon (as kill -9 would), removes its dead mount from
// the state dir as the plugin's supervisor does, starts a daemon of img on
// the same mount point and returns the dead connection and the new one.
func (f *healFixture) restart(img string) (dead, live uint64) {
	dead = connAt(f.t, 0, f.src)
	_ = f.daemon.Process.Kill()
	_ = f.daemon.Wait()
	if err := unix.Unmount(f.src, unix.MNT_DETACH); err != nil {
		f.t.Fatal(err)
	}
	f.daemon = f.startDaemon(img, f.src)
	return dead, connAt(f.t, 0, f.src)
}

// connAt is the connection of the FUSE mount on top at p in pid's
// namespace (0: the test's own), 0 when there is none.
func connAt(t *testing.T, pid int, p string) uint64 {
	t.Helper()
	var conn uint64
	for _, m := range mountnstest.MountsUnder(t, pid, p) {
		if m.Mountpoint == p && strings.HasPrefix(m.FSType, "fuse") {
			conn = uint64(m.Major)<<20 | uint64(m.Minor)
		}
	}
	return conn
}

func stackAt(t *testing.T, pid int, p string) (n int, opts string) {
	t.Helper()
	for _, m := range mountnstest.MountsUnder(t, pid, p) {
		if m.Mountpoint == p {
			n, opts = n+1, m.Options
		}
	}
	return n, opts
}

func staleAt(ms []plan.StaleMount, p string) *plan.StaleMount {
	for i := range ms {
		if ms[i].MountPoint == p {
			return &ms[i]
		}
	}
	return nil
}

// TestHealFuseReplacesEveryCopy: a daemon dies and a new one mounts the
// volume's mount point. Every copy of the dead connection is replaced in
// place, with its own root and flags: a container's bind (writable and
// read-only), a subPath-like bind of a subdirectory, kubelet's target in
// the mounter's own namespace, and one under a shared parent (where the
// kernel refuses a mount beneath). A copy in the mounter's own namespace
// outside kubelet's directory is never touched and is reported left. A
// source whose subdirectory became a symlink is not followed.
func TestHealFuseReplacesEveryCopy(t *testing.T) {
	f := newHealFixture(t)
	private := mountnstest.Namespace(t, "private") // before the FUSE mount: no copy in it
	shared := mountnstest.Namespace(t, "shared")
	f.daemon = f.startDaemon(f.img, f.src)
	ctx := context.Background()
	bind := func(sub string, extra ...string) []plan.Mount {
		return []plan.Mount{{Type: plan.TypeBind, Source: filepath.Join(f.src, sub), Options: opts(extra...)}}
	}
	in := func(name string) string { return filepath.Join(f.dir, name) }
	places := []struct {
		pid    int
		mp     string
		mounts []plan.Mount
		read   string // a file below the mount point, and what it holds
		want   string
	}{
		{private, in("rw"), bind(""), "f", "hello\n"},
		{private, in("ro"), bind("", "ro", "noexec"), "f", "hello\n"},
		{private, in("subpath"), bind("sub"), "g", "below\n"},
		{0, filepath.Join(f.kubelet, "pods", "p1", "mount"), bind(""), "f", "hello\n"},
		{shared, in("shared"), bind(""), "f", "hello\n"},
	}
	for _, p := range places {
		c := plan.Consumer{PID: p.pid, MountPoint: p.mp}
		if err := f.e.Mount(ctx, p.mounts, c); err != nil {
			t.Fatalf("mount at %s (pid %d): %v", p.mp, p.pid, err)
		}
		t.Cleanup(func() { _ = f.e.Unmount(context.Background(), p.mounts, c) })
	}
	outside := filepath.Join(f.dir, "outside")
	if err := os.Mkdir(outside, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(f.src, outside, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(outside, unix.MNT_DETACH) })
	_, roBefore := stackAt(t, private, in("ro"))

	dead, live := f.restart(f.img)
	if b, err := os.ReadFile(inNS(private, filepath.Join(in("rw"), "f"))); err == nil {
		t.Fatalf("the dead copy still reads %q", b)
	}
	res, err := f.e.HealFuse(ctx, plan.Heal{Dead: []uint64{dead}, Source: f.src})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("healed %v; left %v", res.Healed, res.Left)
	for _, p := range places {
		if s := staleAt(res.Healed, p.mp); s == nil || s.Conn != dead {
			t.Errorf("%s (pid %d) is not reported healed", p.mp, p.pid)
		}
		if got := connAt(t, p.pid, p.mp); got != live {
			t.Errorf("%s (pid %d) holds connection %d, want the new %d", p.mp, p.pid, got, live)
		}
		if n, _ := stackAt(t, p.pid, p.mp); n != 1 {
			t.Errorf("%s (pid %d): %d mounts stacked, want the dead one replaced", p.mp, p.pid, n)
		}
		pid := p.pid
		if pid == 0 {
			pid = os.Getpid()
		}
		if b, err := os.ReadFile(inNS(pid, filepath.Join(p.mp, p.read))); err != nil || string(b) != p.want {
			t.Errorf("reading %s through the healed %s: %q, %v", p.read, p.mp, b, err)
		}
	}
	if _, opts := stackAt(t, private, in("ro")); opts != roBefore || !strings.Contains(opts, "ro,") || !strings.Contains(opts, "noexec") {
		t.Errorf("the read-only copy's flags after the heal: %q, before %q", opts, roBefore)
	}
	if s := staleAt(res.Left, outside); len(res.Left) != 1 || s == nil || !strings.Contains(s.Reason, "outside kubelet") {
		t.Errorf("left %v, want only %s (outside kubelet's directory)", res.Left, outside)
	}
	if got := connAt(t, 0, outside); got != dead {
		t.Errorf("the copy outside kubelet's directory was touched: connection %d", got)
	}

	// The new file system's sub is a symlink to /: the subPath copy is not
	// led out of the volume, the others heal.
	dead2, live2 := f.restart(f.imgLinked)
	res, err = f.e.HealFuse(ctx, plan.Heal{Dead: []uint64{dead, dead2}, Source: f.src})
	if err != nil {
		t.Fatal(err)
	}
	sub := in("subpath")
	if s := staleAt(res.Left, sub); s == nil || connAt(t, private, sub) != dead2 {
		t.Errorf("the subPath copy under a symlink: left %v, holds %d", res.Left, connAt(t, private, sub))
	} else {
		t.Logf("refused: %s", s)
	}
	if got := connAt(t, private, in("rw")); got != live2 {
		t.Errorf("rw copy holds %d after the second heal, want %d", got, live2)
	}
	_ = unix.Unmount(outside, unix.MNT_DETACH)
}

// TestHealFuseRefuses: the mounter is a boundary. It replaces nothing for
// a source outside <allowed-root>/fuse/<volume>/mnt, one that is not a FUSE
// mount, or the source's own connection; and it never replaces the mount
// of a connection that still answers.
func TestHealFuseRefuses(t *testing.T) {
	f := newHealFixture(t)
	ns := mountnstest.Namespace(t, "private")
	f.daemon = f.startDaemon(f.img, f.src)
	live := connAt(t, 0, f.src)
	ctx := context.Background()
	other := filepath.Join(f.state, "fuse", "other", "mnt")
	if err := os.MkdirAll(other, 0o750); err != nil {
		t.Fatal(err)
	}
	f.startDaemon(f.img, other)
	otherConn := connAt(t, 0, other)
	mp := filepath.Join(f.dir, "live")
	mounts := []plan.Mount{{Type: plan.TypeBind, Source: other, Options: opts()}}
	c := plan.Consumer{PID: ns, MountPoint: mp}
	if err := f.e.Mount(ctx, mounts, c); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.e.Unmount(context.Background(), mounts, c) }()
	tmpfsVol := filepath.Join(f.state, "fuse", "tmpfs", "mnt")
	if err := os.MkdirAll(tmpfsVol, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", tmpfsVol, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Unmount(tmpfsVol, unix.MNT_DETACH) }()
	notMounted := filepath.Join(f.state, "fuse", "none", "mnt")
	if err := os.MkdirAll(notMounted, 0o750); err != nil {
		t.Fatal(err)
	}
	escape := filepath.Join(f.state, "fuse", "escape")
	if err := os.MkdirAll(filepath.Join(f.dir, "elsewhere", "mnt"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(f.dir, "elsewhere"), escape); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		heal plan.Heal
		want error
	}{
		{"no connection", plan.Heal{Source: f.src}, errdefs.ErrInvalidArgument},
		{"relative source", plan.Heal{Dead: []uint64{1}, Source: "state/fuse/vol/mnt"}, errdefs.ErrInvalidArgument},
		{"outside the roots", plan.Heal{Dead: []uint64{otherConn}, Source: filepath.Dir(f.src)}, errdefs.ErrPermissionDenied},
		{"not the layout", plan.Heal{Dead: []uint64{otherConn}, Source: filepath.Join(f.state, "fuse")}, errdefs.ErrPermissionDenied},
		{"through a symlink", plan.Heal{Dead: []uint64{otherConn}, Source: filepath.Join(escape, "mnt")}, errdefs.ErrPermissionDenied},
		{"not FUSE", plan.Heal{Dead: []uint64{otherConn}, Source: tmpfsVol}, errdefs.ErrPermissionDenied},
		{"not mounted", plan.Heal{Dead: []uint64{otherConn}, Source: notMounted}, errdefs.ErrFailedPrecondition},
		{"its own connection", plan.Heal{Dead: []uint64{live}, Source: f.src}, errdefs.ErrInvalidArgument},
	} {
		_, err := f.e.HealFuse(ctx, tc.heal)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	res, err := f.e.HealFuse(ctx, plan.Heal{Dead: []uint64{otherConn}, Source: f.src})
	if err != nil {
		t.Fatal(err)
	}
	if s := staleAt(res.Left, mp); len(res.Healed) != 0 || s == nil || !strings.Contains(s.Reason, "answers") {
		t.Errorf("a live connection named as dead: healed %v, left %v", res.Healed, res.Left)
	}
	if got := connAt(t, ns, mp); got != otherConn {
		t.Errorf("the live connection's copy was replaced: %d", got)
	}
}
