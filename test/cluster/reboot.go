//go:build clustertest

package cluster

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

// reboot is a power loss of the node and its boot on the same root: the
// node's first process is killed (SIGKILL: no orderly stop, no sync), and
// with it every process of its PID namespace; once they are gone and their
// mount namespaces with them, what the host's kernel keeps but a real
// reboot would not is released (loop devices of the cluster's files, FUSE
// connections, the containers' empty cgroups) and what lives on tmpfs on a
// real node is emptied (/run: containerd's state and sockets, network
// namespaces, NRI's socket). Everything a disk keeps stays: etcd's data,
// the PKI and configurations, kubelet's directory with its pods' stale
// mount points, the plugin's state dir, containerd's root and images. The
// node then starts again and reboot returns once its components run
// (c.started is the boot's start).
//
// Not simulated: data that was written but not synced is not lost, since
// the host's page cache outlives the node.
func (c *Cluster) reboot(t *testing.T) { c.rebootWith(t, nil) }

// rebootWith is reboot with whileDown run after the kill, before the boot
// (on the disk the node left).
func (c *Cluster) rebootWith(t *testing.T, whileDown func()) {
	t.Helper()
	k := c.noteKernelState(t)
	start := time.Now()
	if err := unix.Kill(c.nodePID(), unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.exited:
	case <-time.After(time.Minute):
		t.Fatal("the node process did not exit within a minute of SIGKILL")
	}
	waitFor(t, time.Minute, "every process of the node gone", func() error { return k.processesLeft() })
	waitFor(t, time.Minute, "the node's FUSE connections released", func() error { return k.fuseLeft() })
	waitFor(t, time.Minute, "the node's loop devices detached", func() error { return c.detachLoops() })
	if err := k.removeCgroups(); err != nil {
		t.Error(err)
	}
	if err := c.emptyTmpfs(); err != nil {
		t.Fatal(err)
	}
	c.keepBootLogs(t)
	if whileDown != nil {
		whileDown()
	}
	t.Logf("reboot: node killed and its kernel state released in %v (%d processes, %d mount namespaces, %d FUSE connections, %d container cgroups)",
		time.Since(start).Round(time.Millisecond), len(k.procs), len(k.mountNS), len(k.fuse), len(k.cgroups))
	c.startNode(t)
	for i, w := range c.workers {
		c.wire(t, w, i+2)
	}
}

// kernelState is what the node holds in the host's kernel, noted before
// the kill: its processes (PID and start time, as PIDs are reused), their
// mount namespaces, the FUSE connections mounted in them and the cgroups
// of its containers.
type kernelState struct {
	procs   map[int]string // PID → start time
	mountNS map[uint64]bool
	fuse    []string // /sys/fs/fuse/connections/<dev>
	cgroups []string
}

func (c *Cluster) noteKernelState(t *testing.T) kernelState {
	t.Helper()
	var nodeNS unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/pid", c.nodePID()), &nodeNS); err != nil {
		t.Fatal(err)
	}
	var hostMnt unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &hostMnt); err != nil {
		t.Fatal(err)
	}
	k := kernelState{procs: map[int]string{}, mountNS: map[uint64]bool{}}
	fuse := map[string]bool{}
	cgroups := map[string]bool{}
	v2root, err := testutil.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir("/proc")
	for _, d := range entries {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || !pidNSBelow(pid, nodeNS.Ino) {
			continue
		}
		k.procs[pid] = startTime(pid)
		var mnt unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/ns/mnt", pid), &mnt) != nil || mnt.Ino == hostMnt.Ino {
			continue
		}
		if !k.mountNS[mnt.Ino] {
			k.mountNS[mnt.Ino] = true
			for _, dev := range fuseDevs(pid) {
				fuse[dev] = true
			}
		}
		for _, cg := range containerCgroups(pid, v2root) {
			cgroups[cg] = true
		}
	}
	for dev := range fuse {
		k.fuse = append(k.fuse, filepath.Join("/sys/fs/fuse/connections", dev))
	}
	for cg := range cgroups {
		k.cgroups = append(k.cgroups, cg)
	}
	return k
}

// startTime is field 22 of /proc/PID/stat ("" when the process is gone).
func startTime(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// The command name, in parentheses, may hold spaces: count after it.
	_, rest, ok := strings.Cut(string(b), ") ")
	if f := strings.Fields(rest); ok && len(f) > 19 {
		return f[19]
	}
	return ""
}

// fuseDevs lists the device numbers (the FUSE connections' names) of the
// FUSE mounts in pid's mount namespace.
func fuseDevs(pid int) []string {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil
	}
	defer f.Close()
	var devs []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		i := slices.Index(fields, "-")
		if i < 0 || i+1 >= len(fields) || !strings.HasPrefix(fields[i+1], "fuse") {
			continue
		}
		major, minor, ok := strings.Cut(fields[2], ":")
		if ok && major == "0" {
			devs = append(devs, minor)
		}
	}
	return devs
}

// containerCgroups lists the cgroup directories (one per v1 hierarchy, or
// the v2 one) of a process in a container of the CRI's namespace
// (criNamespace): the node's own processes run in the test's cgroups.
func containerCgroups(pid int, v2root string) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil
	}
	var dirs []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// hierarchy-ID:controller-list:path
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || !strings.HasPrefix(f[2], "/"+criNamespace+"/") {
			continue
		}
		// v1: a hierarchy is mounted at its controllers' joined names
		// ("cpu,cpuacct", "systemd" for name=systemd); v2 at v2root.
		dir := filepath.Join("/sys/fs/cgroup", strings.TrimPrefix(f[1], "name="), f[2])
		if f[0] == "0" && f[1] == "" {
			dir = filepath.Join(v2root, f[2])
		}
		dirs = append(dirs, dir)
	}
	return dirs
}

// processesLeft: an error while a process of the node still runs (or is
// not yet reaped), or a process is still in one of its mount namespaces.
func (k kernelState) processesLeft() error {
	for pid, st := range k.procs {
		if now := startTime(pid); now != "" && now == st {
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
			return fmt.Errorf("process %d (%s) still there", pid, strings.TrimSpace(string(comm)))
		}
	}
	entries, _ := os.ReadDir("/proc")
	for _, d := range entries {
		var st unix.Stat_t
		if unix.Stat(filepath.Join("/proc", d.Name(), "ns", "mnt"), &st) == nil && k.mountNS[st.Ino] {
			return fmt.Errorf("process %s in one of the node's mount namespaces", d.Name())
		}
	}
	return nil
}

// fuseLeft: an error while a FUSE connection of the node's mounts exists
// (the kernel drops it with the last mount of its superblock).
func (k kernelState) fuseLeft() error {
	for _, p := range k.fuse {
		if _, err := os.Stat(p); err == nil {
			return fmt.Errorf("FUSE connection %s still there", p)
		}
	}
	return nil
}

// detachLoops detaches every loop device of the cluster: backed by a file
// under its root (matched by device and inode, as the path the kernel
// shows is the one seen in the container that attached it), or by a path
// under it (kubelet's loop devices over the block volumes' device nodes).
// A device still in use by a mount the kernel drops lazily is left for the
// next call; the error lists what is left.
func (c *Cluster) detachLoops() error {
	loops := c.firstNodeLoops()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), c.cfg.Root+"/") && !strings.HasPrefix(strings.TrimSpace(string(b)), c.cfg.path("nodes")+"/") {
			loops[filepath.Base(filepath.Dir(filepath.Dir(f)))] = strings.TrimSpace(string(b))
		}
	}
	// Loop devices over those devices' nodes (kubelet's over a block
	// volume's), whose path the kernel can no longer name, by the node's
	// device and inode on the host's /dev (the node's too).
	all := loopDevices()
	for added := true; added; {
		added = false
		nodes := map[string]string{}
		for dev := range loops {
			var st unix.Stat_t
			if unix.Stat("/dev/"+dev, &st) == nil {
				nodes[fmt.Sprintf("%d:%d", st.Dev, st.Ino)] = dev
			}
		}
		for dev, id := range all {
			if over, ok := nodes[id]; ok && loops[dev] == "" {
				loops[dev] = "/dev/" + over
				added = true
			}
		}
	}
	var left []string
	for dev, backing := range loops {
		if err := detachLoop(dev); err != nil {
			left = append(left, fmt.Sprintf("%s (%s): %v", dev, backing, err))
		}
	}
	if len(left) > 0 {
		slices.Sort(left)
		return errors.New(strings.Join(left, "; "))
	}
	return nil
}

// detachLoop detaches a loop device nothing holds exclusively (a mounted
// filesystem does): one that another loop device or an open file still
// uses is set to detach at its last close (the kernel's LOOP_CLR_FD), and
// reported as left until that happened.
func detachLoop(dev string) error {
	fd, err := unix.Open("/dev/"+dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		if terr := thawOrphan(dev); terr != nil {
			return fmt.Errorf("%w (thawing it: %v)", err, terr)
		}
		fd, err = unix.Open("/dev/"+dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return err
	}
	err = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
	unix.Close(fd)
	if err != nil && !errors.Is(err, unix.ENXIO) {
		return err
	}
	if _, err := os.Stat(filepath.Join("/sys/block", dev, "loop")); err == nil {
		return errors.New("set to detach at its last close")
	}
	return nil
}

// thawOrphan releases a filesystem on dev that a dead freezer left frozen
// (a snapshot's copy under way at the power loss): a frozen superblock
// keeps itself, and its device, alive with no mount left, where a reboot
// ends it. Mounting the device again finds that superblock, which is
// thawed and unmounted; on a filesystem that is not frozen (a mount still
// going lazily) the thaw is refused and nothing changes.
func thawOrphan(dev string) error {
	dir, err := os.MkdirTemp("", "mp-thaw-")
	if err != nil {
		return err
	}
	defer os.Remove(dir)
	var merr error
	for _, fsType := range []string{"xfs", "ext4"} {
		if merr = unix.Mount("/dev/"+dev, dir, fsType, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); merr == nil {
			break
		}
	}
	if merr != nil {
		return merr
	}
	defer unix.Unmount(dir, 0) //nolint:errcheck // the detach that follows says if it stayed
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	const fithaw = 0xC0045878 // _IOWR('X', 120, int), linux/fs.h
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fithaw, 0); errno != 0 && errno != unix.EINVAL {
		return errno
	}
	return nil
}

// removeCgroups removes the containers' cgroups, deepest first (empty now:
// their processes are gone).
func (k kernelState) removeCgroups() error {
	dirs := slices.Clone(k.cgroups)
	slices.SortFunc(dirs, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, d := range dirs {
		var err error
		for i := 0; i < 20; i++ {
			if err = unix.Rmdir(d); err == nil || errors.Is(err, unix.ENOENT) || !errors.Is(err, unix.EBUSY) {
				break
			}
			time.Sleep(100 * time.Millisecond) // the last process may still be leaving it
		}
		if err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("removing the container cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// emptyTmpfs empties what is tmpfs on a real node (/run): the directory of
// the runtime's sockets, containerd's state dir, and the fixed paths under
// /run the node covers (containerd's shims, network namespaces, NRI); and
// the node's own markers (ready, failed, leftover) of the last boot.
func (c *Cluster) emptyTmpfs() error {
	dirs := []string{c.cfg.path("run"), c.cfg.path("containerd", "state"), c.cfg.path("node")}
	for _, p := range c.cfg.Fixed {
		if strings.HasPrefix(p, "/run/") {
			dirs = append(dirs, c.cfg.fixedSource(p))
		}
	}
	var errs []error
	for _, d := range dirs {
		entries, err := os.ReadDir(d)
		if err != nil && !os.IsNotExist(err) {
			errs = append(errs, err)
		}
		for _, e := range entries {
			if err := os.RemoveAll(filepath.Join(d, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// keepBootLogs moves the copies of the last boot's pod logs (keepPodLogs)
// aside: kubelet starts the new sandboxes' containers at 0.log again,
// which would be copied over them.
func (c *Cluster) keepBootLogs(t *testing.T) {
	t.Helper()
	for n := 1; ; n++ {
		dst := c.cfg.path("logs", fmt.Sprintf("pods-boot%d", n))
		if _, err := os.Stat(dst); err == nil {
			continue
		}
		if err := os.Rename(c.cfg.path("logs", "pods"), dst); err != nil && !os.IsNotExist(err) {
			t.Error(err)
		}
		return
	}
}
