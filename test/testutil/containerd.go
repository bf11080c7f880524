package testutil

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Containerd is a containerd daemon private to one test: its root, state,
// sockets, runc state, FIFOs and log are in one temporary directory, and
// its containers live in a containerd namespace of their own.
//
// Containers run with `ctr run --rootfs DIR`: a plain directory (see
// BusyboxRootfs), no image and no snapshotter. Quirks of containerd 1.6 /
// runc 1.1 (Debian 12) that the helpers handle:
//   - `--rootfs` is a boolean flag: the directory is the first positional
//     argument, before the container ID.
//   - Without an image there is no image config, so the process gets no
//     environment at all, not even PATH, and runc cannot find "sleep":
//     Run passes --env PATH=/bin:/sbin:/usr/bin:/usr/sbin.
//   - runc creates missing mount points (/proc, /dev, /sys, /run) in the
//     root file system, so it must be writable.
//   - ctr defaults FIFOs to /run/containerd/fifo and runc state to
//     /run/containerd/runc: Run and Exec pass --fifo-dir and --runc-root
//     under Dir instead. Shim sockets stay in /run/containerd/s (fixed in
//     containerd 1.6); shims remove them when they exit.
//   - The default config loads the "opt" plugin, which creates
//     /opt/containerd: it is disabled, with cri and the snapshotters that
//     cannot work here (aufs, btrfs, zfs, devmapper).
//   - Each container gets the cgroup /<namespace>/<id> in every hierarchy
//     (cgroup v1 and the v2 "unified" one on this machine). runc removes
//     the container's own cgroups on delete but not the namespace's: Stop
//     removes them.
type Containerd struct {
	Dir       string // everything below lives here
	Root      string // containerd --root
	State     string // containerd --state
	Address   string // gRPC socket
	Namespace string // containerd namespace of this test's containers
	LogPath   string // containerd's stdout and stderr

	cmd        *exec.Cmd
	done       chan struct{}
	stopOnce   sync.Once
	stopErr    error
	mu         sync.Mutex
	containers map[string]*Container
	logTail    string // the log's end, kept when Stop removes Dir
}

const containerdConfig = `version = 2
root = %q
state = %q
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
]

[grpc]
  address = %q

[ttrpc]
  address = %q
`

// StartContainerd starts a private containerd and waits until it answers
// `ctr version` (for at most 30s). A cleanup stops it (see Stop).
func StartContainerd(t testing.TB) *Containerd {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "containerd", "ctr", "runc")
	dir := MarkedTempDir(t, "mpctrd-")
	c := &Containerd{
		Dir:        dir,
		Root:       filepath.Join(dir, "root"),
		State:      filepath.Join(dir, "state"),
		Address:    filepath.Join(dir, "containerd.sock"),
		Namespace:  "mountplan-test-" + strings.TrimPrefix(filepath.Base(dir), "mpctrd-"),
		LogPath:    filepath.Join(dir, "containerd.log"),
		done:       make(chan struct{}),
		containers: map[string]*Container{},
	}
	for _, d := range []string{"fifo", "runc", "logs"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	cfg := filepath.Join(dir, "config.toml")
	conf := fmt.Sprintf(containerdConfig, c.Root, c.State, c.Address, c.Address+".ttrpc")
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(c.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	c.cmd = exec.Command("containerd", "--config", cfg)
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		t.Fatalf("starting containerd: %v", err)
	}
	go func() { _ = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stopping containerd: %v", err)
		}
		if t.Failed() {
			t.Logf("containerd log, last lines:\n%s", c.logTail)
		}
	})

	var lastErr error
	up := Poll(30*time.Second, 20*time.Millisecond, func() bool {
		if closed(c.done) {
			return true
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, lastErr = runCmd(ctx, "ctr", "--address", c.Address, "version")
		return lastErr == nil
	})
	select {
	case <-c.done:
		t.Fatalf("containerd exited at start (%v); log:\n%s", c.cmd.ProcessState, tailFile(c.LogPath, 40))
	default:
	}
	if !up {
		t.Fatalf("containerd did not answer within 30s: %v; log:\n%s", lastErr, tailFile(c.LogPath, 40))
	}
	return c
}

// Ctr runs `ctr --address ADDRESS -n NAMESPACE args...` and returns its
// standard output; for what the helpers do not cover.
func (c *Containerd) Ctr(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return runCmd(ctx, "ctr", append([]string{"--address", c.Address, "-n", c.Namespace}, args...)...)
}

// Container is a running task started by Containerd.Run.
type Container struct {
	ID      string
	Rootfs  string
	LogPath string // the container's stdout and stderr

	c        *Containerd
	pid      int
	start    uint64
	killOnce sync.Once
	killErr  error
}

var execSeq atomic.Int64

// Run starts a container detached, with `ctr run --rootfs` over rootfs, and
// waits until its process runs. id must be unique within this Containerd.
// argv is looked up in the container's PATH (/bin:/sbin:/usr/bin:/usr/sbin).
// The container runs unprivileged with containerd's default spec: its own
// mount, PID, IPC, UTS and network namespaces. A cleanup kills it.
func (c *Containerd) Run(t testing.TB, id, rootfs string, argv ...string) *Container {
	t.Helper()
	return c.RunWithBinds(t, id, rootfs, nil, argv...)
}

// RunWithBinds is Run with host paths bound into the container by the
// runtime (`ctr run --mount type=bind,...,options=rbind:rw`), as a
// container runtime binds kubelet's publish target into a pod's
// container: binds maps a path inside the container to the host path.
func (c *Containerd) RunWithBinds(t testing.TB, id, rootfs string, binds map[string]string, argv ...string) *Container {
	t.Helper()
	if len(argv) == 0 {
		t.Fatal("Containerd.Run: no command")
	}
	ct := &Container{ID: id, Rootfs: rootfs, LogPath: filepath.Join(c.Dir, "logs", id+".log"), c: c}
	pidFile := filepath.Join(c.Dir, "logs", id+".pid")
	args := []string{"run", "--detach",
		"--log-uri", "file://" + ct.LogPath,
		"--fifo-dir", filepath.Join(c.Dir, "fifo"),
		"--runc-root", filepath.Join(c.Dir, "runc"),
		"--pid-file", pidFile,
		"--env", "PATH=/bin:/sbin:/usr/bin:/usr/sbin"}
	for dst, src := range binds {
		args = append(args, "--mount", fmt.Sprintf("type=bind,src=%s,dst=%s,options=rbind:rw", src, dst))
	}
	args = append(args, "--rootfs", rootfs, id)
	c.mu.Lock()
	c.containers[id] = ct
	c.mu.Unlock()
	t.Cleanup(func() { ct.Kill(t) })
	if _, err := c.Ctr(append(args, argv...)...); err != nil {
		t.Fatalf("running container %s: %v", id, err)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatalf("container %s: %v", id, err)
	}
	ct.pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("container %s: pid file: %v", id, err)
	}
	p, ok := readProc(ct.pid)
	if !ok {
		t.Fatalf("container %s: process %d exited at once; its output:\n%s", id, ct.pid, tailFile(ct.LogPath, 20))
	}
	ct.start = p.StartTime
	return ct
}

// PID returns the host PID of the container's init process.
func (ct *Container) PID() int { return ct.pid }

// MountNS returns the identity of the container's mount namespace, like
// "mnt:[4026532283]".
func (ct *Container) MountNS() string {
	ns, _ := MountNamespaceOf(ct.pid)
	return ns
}

// Exec runs argv in the container (`ctr task exec`) and returns its
// standard output. On failure (ctr passes the exit status through) the
// error carries the exit status and standard error.
func (ct *Container) Exec(t testing.TB, argv ...string) (string, error) {
	t.Helper()
	args := []string{"task", "exec",
		"--exec-id", fmt.Sprintf("exec-%d", execSeq.Add(1)),
		"--fifo-dir", filepath.Join(ct.c.Dir, "fifo"),
		ct.ID}
	return ct.c.Ctr(append(args, argv...)...)
}

// ExecRead is Exec for a command that only reads and always prints
// something: `ctr task exec` now and then returns nothing, with success,
// for a process that exits at once (its output fifo is drained after the
// exit is seen), so an empty answer is asked again, up to three times.
func (ct *Container) ExecRead(t testing.TB, argv ...string) (string, error) {
	t.Helper()
	var out string
	var err error
	for range 3 {
		if out, err = ct.Exec(t, argv...); err != nil || out != "" {
			break
		}
	}
	return out, err
}

// Kill kills the container's processes with SIGKILL, waits until the task
// has stopped, and deletes the task and the container. Its mount namespace
// goes with it. Calling Kill again does nothing.
func (ct *Container) Kill(t testing.TB) {
	t.Helper()
	if err := ct.kill(); err != nil {
		t.Errorf("killing container %s: %v", ct.ID, err)
	}
}

func (ct *Container) kill() error {
	ct.killOnce.Do(func() {
		ct.killErr = ct.doKill()
		ct.c.mu.Lock()
		delete(ct.c.containers, ct.ID)
		ct.c.mu.Unlock()
	})
	return ct.killErr
}

func (ct *Container) doKill() error {
	c := ct.c
	status, err := c.taskStatus(ct.ID)
	if err != nil {
		return err
	}
	if status != "" {
		if status != "STOPPED" {
			if _, err := c.Ctr("task", "kill", "--all", "--signal", "SIGKILL", ct.ID); err != nil {
				return err
			}
			if !Poll(10*time.Second, 10*time.Millisecond, func() bool {
				status, err = c.taskStatus(ct.ID)
				return err != nil || status == "STOPPED" || status == ""
			}) {
				return fmt.Errorf("task still %s 10s after SIGKILL", status)
			}
			if err != nil {
				return err
			}
		}
		if _, err := c.Ctr("task", "delete", ct.ID); err != nil {
			return err
		}
	}
	if out, err := c.Ctr("container", "list", "--quiet"); err != nil {
		return err
	} else if containsLine(out, ct.ID) {
		if _, err := c.Ctr("container", "delete", ct.ID); err != nil {
			return err
		}
	}
	if ct.pid != 0 && !Poll(5*time.Second, 10*time.Millisecond, func() bool { return !alive(ct.pid, ct.start) }) {
		return fmt.Errorf("process %d still alive after the task was deleted", ct.pid)
	}
	return nil
}

func containsLine(out, line string) bool {
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) == line {
			return true
		}
	}
	return false
}

// taskStatus returns the status of task id (RUNNING, STOPPED, ...) or ""
// when there is no such task.
func (c *Containerd) taskStatus(id string) (string, error) {
	out, err := c.Ctr("task", "list")
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(out, "\n")[1:] {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == id {
			return f[2], nil
		}
	}
	return "", nil
}

// Stop kills the containers still running, stops containerd (SIGTERM, then
// SIGKILL after 10s), kills the shims that remain, unmounts what is left
// under Dir, removes the namespace's cgroups and then Dir. It returns what
// went wrong; calling it again returns the same.
func (c *Containerd) Stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.stop() })
	return c.stopErr
}

func (c *Containerd) stop() error {
	var errs []error
	c.mu.Lock()
	var cts []*Container
	for _, ct := range c.containers {
		cts = append(cts, ct)
	}
	c.mu.Unlock()
	for _, ct := range cts {
		if err := ct.kill(); err != nil {
			errs = append(errs, fmt.Errorf("container %s: %w", ct.ID, err))
		}
	}

	errs = append(errs, terminate(c.cmd.Process, c.done, "containerd"))
	var more []error
	c.logTail, more = cleanUpAfter(c.Address, c.Dir, c.LogPath, func() error { return RemoveCgroupTree(c.Namespace) })
	return errors.Join(append(errs, more...)...)
}

// cleanUpAfter cleans up after a stopped containerd whose files are under
// dir: kills its shims (those whose tasks were deleted exit by
// themselves), detaches what is left mounted under dir, removes its
// cgroups, and then dir. It returns the end of its log.
func cleanUpAfter(address, dir, logPath string, removeCgroups func() error) (logTail string, errs []error) {
	errs = append(errs, killShims(address), unmountUnder(dir), removeCgroups())
	logTail = tailFile(logPath, 60)
	return logTail, append(errs, removeAllNoMounts(dir))
}

// mountsUnder lists the mount points at or under dir in our mount
// namespace, deepest first.
func mountsUnder(dir string) ([]string, error) {
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, err
	}
	var mps []string
	for _, mi := range infos {
		mps = append(mps, mi.Mountpoint)
	}
	sort.Slice(mps, func(i, j int) bool { return len(mps[i]) > len(mps[j]) })
	return mps, nil
}

// unmountUnder detaches every mount at or under dir and says which there
// were: after a clean stop there are none.
func unmountUnder(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil || len(mps) == 0 {
		return err
	}
	for _, mp := range mps {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
	}
	return fmt.Errorf("mounts left under %s, detached: %s", dir, strings.Join(mps, ", "))
}

// removeAllNoMounts removes dir unless something is mounted under it:
// os.RemoveAll would descend into the mount and delete its contents.
func removeAllNoMounts(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if len(mps) > 0 {
		return fmt.Errorf("not removing %s: still mounted under it: %s", dir, strings.Join(mps, ", "))
	}
	return os.RemoveAll(dir)
}

// tailFile returns the last n lines of a file.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// busyboxApplets are linked when `busybox --list` is unavailable.
var busyboxApplets = []string{"sh", "cat", "ls", "sleep", "echo", "stat", "mount", "umount", "grep", "touch", "mkdir", "rm", "dd", "sync", "test", "true", "false"}

// BusyboxRootfs builds a root file system for containers in a temporary
// directory: the static busybox as /bin/busybox with a symlink in /bin for
// each of its applets (sh, cat, ls, sleep, echo, stat, mount, grep, ...),
// empty /proc /sys /dev /tmp /mnt /run, and an /etc/passwd for root. It
// is writable: runc needs that. It stops the test (Missing) when busybox is
// missing or not statically linked (Debian's busybox-static is).
func BusyboxRootfs(t testing.TB) string {
	t.Helper()
	RequireCommands(t, "busybox")
	bb, _ := exec.LookPath("busybox")
	if f, err := elf.Open(bb); err != nil {
		Missing(t, "a static busybox (Debian package busybox-static): %s is not an ELF binary: %v", bb, err)
	} else {
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				Missing(t, "a static busybox (Debian package busybox-static): %s is dynamically linked", bb)
			}
		}
	}
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "mnt", "etc", "run", "root", "var"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := CopyFile(bb, filepath.Join(root, "bin", "busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	applets := busyboxApplets
	if out, err := exec.Command(bb, "--list").Output(); err == nil {
		applets = strings.Fields(string(out))
	}
	for _, a := range applets {
		if a == "busybox" || strings.Contains(a, "/") {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	}
	etc := map[string]string{
		"passwd": "root:x:0:0:root:/root:/bin/sh\n",
		"group":  "root:x:0:\n",
	}
	for name, content := range etc {
		if err := os.WriteFile(filepath.Join(root, "etc", name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// CopyFile copies src to dst (created or truncated, with mode).
func CopyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
