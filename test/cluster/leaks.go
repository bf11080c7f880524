//go:build clustertest

package cluster

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// snapshot is the host state the cluster must leave as it found it.
type snapshot struct {
	loops   map[string]string // loop device → "dev:inode" of its backing file
	mounts  []string          // the host's mount table: mount point, source, type
	fixed   map[string]string // each fixed path: "absent" or its listing
	cgroups []string          // cgroup directories two levels deep
	links   []string          // network interfaces
}

func takeSnapshot(t *testing.T, root string) snapshot {
	t.Helper()
	s := snapshot{loops: loopDevices(), fixed: map[string]string{}}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		i := slices.Index(fields, "-")
		if i < 0 || i+2 >= len(fields) {
			continue
		}
		s.mounts = append(s.mounts, fields[4]+" "+fields[i+2]+" "+fields[i+1])
	}
	for _, p := range fixedPaths {
		entries, err := os.ReadDir(p)
		if err != nil {
			s.fixed[p] = "absent"
			continue
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		s.fixed[p] = strings.Join(names, ",")
	}
	launcher := launcherCgroups()
	ctrls, _ := os.ReadDir("/sys/fs/cgroup")
	for _, c := range ctrls {
		dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", c.Name(), "*", "*"))
		top, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", c.Name(), "*"))
		for _, d := range append(top, dirs...) {
			if filepath.Dir(d) == launcher[c.Name()] {
				continue
			}
			if fi, err := os.Stat(d); err == nil && fi.IsDir() {
				s.cgroups = append(s.cgroups, d)
			}
		}
	}
	links, _ := os.ReadDir("/sys/class/net")
	for _, l := range links {
		s.links = append(s.links, l.Name())
	}
	return s
}

// launcherCgroups maps each cgroup v1 controller in which this test runs
// below the root to the directory that holds its cgroup. Whatever started
// the test (a CI runner, a job scheduler) may make and remove sibling
// cgroups there for its other jobs at any time: they are not the cluster's.
func launcherCgroups() map[string]string {
	out := map[string]string{}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return out
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// hierarchy-ID:controller-list:path
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || f[1] == "" || f[2] == "/" {
			continue
		}
		ctrl := strings.TrimPrefix(f[1], "name=")
		out[ctrl] = filepath.Dir(filepath.Join("/sys/fs/cgroup", ctrl, f[2]))
	}
	return out
}

// loopDevices maps each attached loop device to its backing file's device
// and inode (LOOP_GET_STATUS64): a path says little once the plugin's
// container, in whose mount namespace it was attached, is gone.
func loopDevices() map[string]string {
	m := map[string]string{}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		fd, err := unix.Open("/dev/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			m[name] = "unknown: " + err.Error()
			continue
		}
		st, err := unix.IoctlLoopGetStatus64(fd)
		unix.Close(fd)
		if err != nil {
			continue // detached meanwhile
		}
		m[name] = fmt.Sprintf("%d:%d", st.Device, st.Inode)
	}
	return m
}

// diff lists what after has that s had not (or lost), as leaks.
func (s snapshot) diff(after snapshot) []string {
	var leaks []string
	for dev, id := range after.loops {
		if s.loops[dev] != id {
			leaks = append(leaks, fmt.Sprintf("loop device %s (backing file %s)", dev, id))
		}
	}
	for _, m := range after.mounts {
		if !slices.Contains(s.mounts, m) {
			leaks = append(leaks, "host mount "+m)
		}
	}
	for p, was := range s.fixed {
		if now := after.fixed[p]; now != was {
			leaks = append(leaks, fmt.Sprintf("fixed path %s: %q before, %q after", p, was, now))
		}
	}
	for _, cg := range after.cgroups {
		if !slices.Contains(s.cgroups, cg) {
			leaks = append(leaks, "cgroup "+cg)
		}
	}
	for _, l := range after.links {
		if !slices.Contains(s.links, l) {
			leaks = append(leaks, "network interface on the host "+l)
		}
	}
	return leaks
}

// cleanStale removes what an interrupted earlier run left: its node is
// gone with its namespaces, but loop devices and files stay.
func cleanStale(t *testing.T, root string) {
	t.Helper()
	if _, err := os.Stat(root); os.IsNotExist(err) {
		return
	}
	t.Logf("removing %s left by an earlier run", root)
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		t.Fatal(err)
	}
	for dev := range loopsBackedUnder(root) {
		if fd, err := unix.Open("/dev/"+dev, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
			unix.Close(fd)
		}
	}
	if b, err := os.ReadFile(filepath.Join(root, "created")); err == nil {
		for _, d := range strings.Fields(string(b)) {
			if err := removeEmptyTree(d); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.RemoveAll(root); err != nil {
		t.Fatal(err)
	}
}

// checkNodeClean checks inside each node, once every volume is deleted: no
// mount under the state dir or kubelet's volume directories in the node's
// mount namespace, no volume image file, no record left in the mounter's
// records dir (of a device or mount it set up), no loop device backed by a
// file of the node's (under the cluster's directory on the first node, in
// its state filesystem on a worker).
func (e *env) checkNodeClean(t *testing.T) {
	t.Helper()
	for _, n := range e.c.nodes() {
		e.checkCleanOn(t, n, false)
	}
}

// checkCleanOn is checkNodeClean on one node. With mounterUp, the
// mounter's NRI guard (a FUSE mount under the state dir, and its record),
// which stands as long as the mounter runs, is not a leak.
func (e *env) checkCleanOn(t *testing.T, n *Cluster, mounterUp bool) {
	t.Helper()
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", n.nodePID()))
	if err != nil {
		t.Fatal(err)
	}
	state, kubelet := e.c.cfg.path("state"), e.c.cfg.path("kubelet")
	for _, l := range strings.Split(string(mi), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 {
			continue
		}
		mp := f[4]
		if mounterUp && strings.Contains(l, " - "+guardFSType+" ") {
			continue
		}
		if strings.HasPrefix(mp, state+"/") ||
			strings.HasPrefix(mp, kubelet+"/pods/") && strings.Contains(mp, "kubernetes.io~csi") ||
			strings.HasPrefix(mp, kubelet+"/plugins/kubernetes.io/csi/") {
			t.Errorf("leak: mount in node %s: %s", n.cfg.name(), l)
		}
	}
	_ = filepath.WalkDir(n.seen(e.c.cfg.path("state", "images")), func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			t.Errorf("leak: volume image left on %s: %s", n.cfg.name(), p)
		}
		return nil
	})
	_ = filepath.WalkDir(n.seen(e.c.cfg.path("state")+"-mounter"), func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			b, _ := os.ReadFile(p)
			if mounterUp && strings.Contains(string(b), `"kind":"guard"`) {
				return nil
			}
			t.Errorf("leak: the mounter's record %s left on %s: %s", p, n.cfg.name(), strings.TrimSpace(string(b)))
		}
		return nil
	})
	for dev, p := range e.c.loopsOf(n) {
		t.Errorf("leak: %s still backed by %s on %s", dev, p, n.cfg.name())
	}
}

// loopsOf are the loop devices backed by files of node n: the first node's
// (firstNodeLoops), or those in a worker's state filesystem.
func (c *Cluster) loopsOf(n *Cluster) map[string]string {
	if n.cfg.worker() {
		return loopsBackedUnder(n.seen(c.cfg.path("state")))
	}
	return c.firstNodeLoops()
}

// guardFSType is the type of the mounter's NRI guard mount.
const guardFSType = "fuse.mountplan-nri-guard"

// firstNodeLoops are the loop devices backed by files of the first node:
// under the cluster's root and not under the workers' directories (where
// each worker's state filesystem lies, and its volumes' images).
func (c *Cluster) firstNodeLoops() map[string]string {
	return loopsBackedUnder(c.cfg.Root, c.cfg.path("nodes"))
}

// loopsBackedUnder returns the loop devices (loopN → file) backed by a
// regular file below root and not below skip (another node's directories),
// matched by the device and inode of the file.
func loopsBackedUnder(root string, skip ...string) map[string]string {
	inodes := map[string]string{}
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && slices.Contains(skip, p) {
			return filepath.SkipDir
		}
		if err == nil && d.Type().IsRegular() {
			var st unix.Stat_t
			if unix.Lstat(p, &st) == nil {
				inodes[fmt.Sprintf("%d:%d", st.Dev, st.Ino)] = p
			}
		}
		return nil
	})
	backed := map[string]string{}
	for dev, id := range loopDevices() {
		if p, ok := inodes[id]; ok {
			backed[dev] = p
		}
	}
	return backed
}
