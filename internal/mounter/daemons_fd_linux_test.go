//go:build linux

package mounter_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/testutil"
)

const fuse0600ChildEnv = "MOUNTPLAN_FUSE0600_CHILD"

// TestFdModeWhereDevFuseIs0600 (issue 34): on a node whose /dev/fuse is
// crw------- a daemon of another user than root cannot open it, so a
// profile with runAs cannot mount by itself; in fd mode the mounter opens
// it and the same daemon serves. The host's /dev/fuse is left alone (other
// test binaries run beside this one): a child of the test runs in a mount
// namespace of its own, where a node 10:229 of mode 0600 is bound over
// /dev/fuse. The parent checks that nothing is left.
func TestFdModeWhereDevFuseIs0600(t *testing.T) {
	if os.Getenv(fuse0600ChildEnv) != "" {
		fuse0600Child(t)
		return
	}
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "unshare", "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	testutil.NoLeaks(t)
	cmd := exec.Command("unshare", "-m", "--propagation", "private", os.Args[0], "-test.run=^TestFdModeWhereDevFuseIs0600$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), fuse0600ChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("the child in a mount namespace of its own:\n%s", out)
	if err != nil {
		t.Errorf("the child: %v", err)
	}
	if !strings.Contains(string(out), "/dev/fuse is crw------- here") {
		t.Error("the child did not run with /dev/fuse of mode 0600")
	}
}

// fuse0600Child is the test in the child's mount namespace.
func fuse0600Child(t *testing.T) {
	dev := t.TempDir()
	if err := unix.Mount("mountplan-test-dev", dev, "tmpfs", unix.MS_NOSUID, "mode=0755,size=64k"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dev, unix.MNT_DETACH) })
	node := filepath.Join(dev, "fuse")
	if err := unix.Mknod(node, unix.S_IFCHR|0o600, int(unix.Mkdev(10, 229))); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(node, 0o600); err != nil { // past the umask
		t.Fatal(err)
	}
	if err := unix.Mount(node, "/dev/fuse", "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount("/dev/fuse", unix.MNT_DETACH) })
	fi, err := os.Stat("/dev/fuse")
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeCharDevice == 0 {
		t.Fatalf("/dev/fuse after the bind: %v, %v", fi, err)
	}
	t.Logf("/dev/fuse is %s here (mode %04o, device 10:229)", strings.Replace(fi.Mode().String(), "Dc", "c", 1), fi.Mode().Perm())
	f := daemonFixtureIn(t)
	t.Run("fd mode serves", func(t *testing.T) {
		info, err := f.n.StartDaemon(context.Background(), f.request("fd", "squashfuse-user-fd"))
		if err != nil {
			t.Fatalf("StartDaemon in fd mode: %v", err)
		}
		if b, err := os.ReadFile(filepath.Join(info.MountPoint, "hello.txt")); err != nil || string(b) != "from squashfs\n" {
			t.Errorf("reading through the mount: %q, %v", b, err)
		}
		st := mountnstest.ProcStatus(t, info.PID)
		if uid := strings.Fields(st["Uid"]); len(uid) == 0 || uid[0] != "65534" {
			t.Errorf("the daemon's Uid %q, want 65534", st["Uid"])
		}
		if err := f.n.StopDaemons(context.Background(), "fd", nil, true); err != nil {
			t.Fatal(err)
		}
		f.gone("fd")
	})
	t.Run("the daemon mounting itself fails", func(t *testing.T) {
		req := f.request("old", "squashfuse-user")
		req.ReadyTimeout = 5 * time.Second
		info, err := f.n.StartDaemon(context.Background(), req)
		if err == nil {
			_ = f.n.StopDaemons(context.Background(), "old", nil, true)
			t.Fatalf("a daemon of user nobody mounted by itself with /dev/fuse 0600: %+v", info)
		}
		t.Logf("the same profile without fd mode: %v", err)
		// Refused before the daemon runs (fuseDeviceOpenableBy), with
		// what to do: not after its ready timeout, from its log.
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "/dev/fuse (mode 0600") || !strings.Contains(err.Error(), "fdMount: true") {
			t.Errorf("StartDaemon = %v; want FailedPrecondition naming /dev/fuse's mode and fdMount", err)
		}
		f.gone("old")
	})
}

// TestFdModeDaemonHoldsNothing (issue 34): in fd mode the daemon, seen
// from its own /proc status, runs as a user other than root with no
// capability in any set and no_new_privs, gets /dev/fuse as fd 3 and its
// mount point as /dev/fd/3; the mount is the mounter's, of type
// fuse.<binary> with the daemon's user as its owner. It runs in mount,
// PID, IPC and UTS namespaces of its own, its root a minimal tree
// (checkSandboxed). The mounter keeps no
// copy of the descriptor: a killed daemon's mount answers ENOTCONN at
// once instead of hanging its callers.
func TestFdModeDaemonHoldsNothing(t *testing.T) {
	for _, tt := range []struct{ profile, tool, file, content string }{
		{"squashfuse-fd", "squashfuse", "hello.txt", "from squashfs\n"},
		{"sshfs-fd", "sshfs", "hello.txt", "over sftp\n"},
	} {
		t.Run(tt.profile, func(t *testing.T) {
			mountnstest.RequireTool(t, tt.tool)
			if tt.tool == "sshfs" {
				testenv.RequireFile(t, "/usr/lib/openssh/sftp-server", "sftp-server (Debian package openssh-sftp-server)")
			}
			f := newDaemonFixture(t)
			info := f.start(f.request(tt.profile, tt.profile))
			if b, err := os.ReadFile(filepath.Join(info.MountPoint, tt.file)); err != nil || string(b) != tt.content {
				t.Errorf("reading through the mount: %q, %v", b, err)
			}
			st := mountnstest.ProcStatus(t, info.PID)
			t.Logf("the daemon's status: Uid %s, Gid %s, CapInh %s CapPrm %s CapEff %s CapBnd %s CapAmb %s, NoNewPrivs %s",
				st["Uid"], st["Gid"], st["CapInh"], st["CapPrm"], st["CapEff"], st["CapBnd"], st["CapAmb"], st["NoNewPrivs"])
			for _, id := range append(strings.Fields(st["Uid"]), strings.Fields(st["Gid"])...) {
				if id == "0" {
					t.Errorf("the daemon runs as root: Uid %q Gid %q", st["Uid"], st["Gid"])
					break
				}
			}
			for _, field := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
				if got := mountnstest.CapSet(t, st, field); got != 0 {
					t.Errorf("%s %016x, want none", field, got)
				}
			}
			if st["NoNewPrivs"] != "1" {
				t.Errorf("NoNewPrivs %q, want 1", st["NoNewPrivs"])
			}
			if l, err := os.Readlink("/proc/" + strconv.Itoa(info.PID) + "/fd/3"); err != nil || l != "/dev/fuse" {
				t.Errorf("the daemon's fd 3 is %q, %v; want /dev/fuse", l, err)
			}
			if !slices.Contains(info.Command.Args, "/dev/fd/3") || slices.Contains(info.Command.Args, info.MountPoint) {
				t.Errorf("the daemon's arguments %q: want /dev/fd/3 where the mount point was", info.Command.Args)
			}
			checkSandboxed(t, f, tt.profile, info.PID)
			if held := fuseDescriptors(t); held > 0 {
				t.Errorf("the mounter (this process) holds %d descriptors of /dev/fuse after the start", held)
			}
			ms := mountnstest.MountsUnder(t, 0, info.MountPoint)
			if len(ms) != 1 || ms[0].FSType != "fuse."+tt.tool || !strings.Contains(ms[0].VFSOptions, "user_id=65534") ||
				!strings.Contains(ms[0].VFSOptions, "allow_other") || !strings.Contains(ms[0].Options, "nosuid") {
				for _, m := range ms {
					t.Logf("mount: %s %s %s %s", m.FSType, m.Source, m.Options, m.VFSOptions)
				}
				t.Errorf("want one mount of type fuse.%s, user_id=65534, allow_other, nosuid", tt.tool)
			}
			// Killed, it leaves a connection nobody holds: aborted, its
			// mount answers ENOTCONN rather than blocking.
			if err := syscall.Kill(info.PID, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			waitGone(t, f.n, info.Proc)
			done := make(chan error, 1)
			go func() {
				_, err := os.Stat(filepath.Join(info.MountPoint, tt.file))
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, syscall.ENOTCONN) && !errors.Is(err, syscall.ECONNABORTED) {
					t.Errorf("a stat on the killed daemon's mount = %v, want ENOTCONN or ECONNABORTED", err)
				}
			case <-time.After(5 * time.Second):
				t.Error("a stat on the killed daemon's mount hangs: someone still holds its /dev/fuse descriptor")
				_ = f.n.StopDaemons(context.Background(), tt.profile, nil, false) // aborts it
			}
			f.stop(tt.profile, true)
			f.gone(tt.profile)
		})
	}
}

// fuseDescriptors counts this process's descriptors of /dev/fuse.
func fuseDescriptors(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && l == "/dev/fuse" {
			n++
		}
	}
	return n
}

// checkSandboxed checks, from the daemon's own view (its /proc entries,
// read from here), that it runs in a mount namespace and a PID namespace
// of its own (and IPC and UTS ones) whose root holds only the system's
// directories read-only, a /dev of null, zero, random and urandom, a /proc
// of its own PID namespace, and of the node's state dir (the fixture's
// kubelet dir too) only its own volume's work/ and secrets/, and the
// profile's source root read-only: no FUSE mount, no /dev/fuse, no host
// device.
func checkSandboxed(t *testing.T, f *daemonFixture, id string, pid int) {
	t.Helper()
	proc := "/proc/" + strconv.Itoa(pid)
	for _, ns := range []string{"mnt", "pid", "ipc", "uts"} {
		mine, err1 := os.Readlink("/proc/self/ns/" + ns)
		its, err2 := os.Readlink(proc + "/ns/" + ns)
		if err1 != nil || err2 != nil || mine == its {
			t.Errorf("the daemon's %s namespace is %q (%v), the mounter's %q (%v): want one of its own", ns, its, err2, mine, err1)
		}
	}
	st := mountnstest.ProcStatus(t, pid)
	if nspid := strings.Fields(st["NSpid"]); len(nspid) != 2 || nspid[1] != "1" {
		t.Errorf("the daemon's NSpid %q: want its host PID and 1 (the first process of a PID namespace of its own)", st["NSpid"])
	}
	if st["Seccomp"] != "2" || st["Seccomp_filters"] != "1" {
		t.Errorf("the daemon's Seccomp %q, Seccomp_filters %q: want 2 and 1 (its filter, internal/daemon's daemonPolicy)", st["Seccomp"], st["Seccomp_filters"])
	}
	vol := f.volDir(id)
	ownDirs := []string{filepath.Join(vol, "work"), filepath.Join(vol, "secrets")}
	readOnly := []string{"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", f.images}
	devices := []string{"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"}
	ms := mountnstest.MountsUnder(t, pid, "/")
	for _, m := range ms {
		t.Logf("the daemon's mount: %s on %s (root %s) %s %s", m.FSType, m.Mountpoint, m.Root, m.Options, m.VFSOptions)
		ro := slices.Contains(strings.Split(m.Options, ","), "ro")
		switch {
		case mountns.IsFuse(m):
			t.Errorf("the daemon sees a FUSE mount at %s", m.Mountpoint)
		case m.Mountpoint == "/":
			if m.FSType != "tmpfs" || !ro {
				t.Errorf("the daemon's root is %s (%s), want a read-only tmpfs of its own", m.FSType, m.Options)
			}
		case m.Mountpoint == "/proc":
			if m.FSType != "proc" {
				t.Errorf("the daemon's /proc is %s", m.FSType)
			}
		case slices.Contains(devices, m.Mountpoint):
		case slices.ContainsFunc(ownDirs, func(d string) bool { return plan.Within(d, m.Mountpoint) }):
		case slices.ContainsFunc(readOnly, func(d string) bool { return plan.Within(d, m.Mountpoint) }):
			if !ro {
				t.Errorf("%s is writable in the daemon's root", m.Mountpoint)
			}
		default:
			t.Errorf("the daemon sees a mount it does not need: %s on %s (root %s)", m.FSType, m.Mountpoint, m.Root)
		}
		if plan.Within(f.state, m.Mountpoint) && !slices.ContainsFunc(ownDirs, func(d string) bool { return plan.Within(d, m.Mountpoint) }) {
			t.Errorf("the daemon sees %s of the state (and kubelet) dir, not its own volume's", m.Mountpoint)
		}
		if m.Mountpoint == "/dev" || m.FSType == "devtmpfs" && !slices.Contains(devices, m.Mountpoint) {
			t.Errorf("the daemon sees the host's /dev: %s on %s", m.FSType, m.Mountpoint)
		}
	}
	root := proc + "/root"
	ents, err := os.ReadDir(root + "/dev")
	if err != nil {
		t.Errorf("the daemon's /dev: %v", err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	t.Logf("the daemon's /dev: %v", names)
	for _, n := range names {
		if !slices.Contains([]string{"null", "zero", "random", "urandom", "fd", "stdin", "stdout", "stderr"}, n) {
			t.Errorf("the daemon's /dev holds %s", n)
		}
	}
	for _, dev := range []string{"/dev/fuse", "/dev/loop-control", "/dev/sda", "/dev/kmsg", "/dev/mem"} {
		if fd, err := unix.Open(root+dev, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			unix.Close(fd)
			t.Errorf("%s opens in the daemon's root", dev)
		} else if !errors.Is(err, unix.ENOENT) {
			t.Errorf("opening %s in the daemon's root: %v, want ENOENT", dev, err)
		}
	}
	// Of the test's directory (the state dir, the images, the rest), the
	// daemon's root holds its own volume's dirs and the images' root, and
	// the directories that lead to them: nothing else.
	allowed := append(slices.Clone(ownDirs), f.images)
	_ = filepath.WalkDir(root+f.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel := strings.TrimPrefix(p, root)
		switch {
		case slices.ContainsFunc(allowed, func(a string) bool { return plan.Within(a, rel) }):
			return fs.SkipDir
		case !slices.ContainsFunc(allowed, func(a string) bool { return plan.Within(rel, a) }):
			t.Errorf("the daemon's root holds %s", rel)
			if d.IsDir() {
				return fs.SkipDir
			}
		}
		return nil
	})
	pids, err := os.ReadDir(root + "/proc")
	if err != nil {
		t.Fatalf("the daemon's /proc: %v", err)
	}
	var seen []string
	for _, e := range pids {
		if _, err := strconv.Atoi(e.Name()); err == nil {
			seen = append(seen, e.Name())
		}
	}
	t.Logf("the daemon's /proc lists the processes %v", seen)
	if !slices.Contains(seen, "1") || len(seen) > 3 {
		t.Errorf("the daemon's /proc lists %v: want its own few processes, 1 among them", seen)
	}
}

// sftpServer serves sftp-server on a loopback port (sshfs's directport)
// until the test ends: each connection gets a sftp-server of its own, as
// root, in the test's namespaces. It returns the port.
func sftpServer(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serveSftp(c)
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

func serveSftp(c net.Conn) {
	defer c.Close()
	cmd := exec.Command("/usr/lib/openssh/sftp-server")
	in, err := cmd.StdinPipe()
	if err != nil {
		return
	}
	cmd.Stdout = c
	if cmd.Start() != nil {
		return
	}
	_, _ = io.Copy(in, bufio.NewReader(c))
	in.Close()
	_ = cmd.Wait()
}
