package cgroup

// Daemons outside the mounter's cgroup (SetupOutside): a container's
// runtime finds the processes to kill at its stop through the container's
// cgroups (runc: cgroup.kill or cgroup.procs of its v2 cgroup; on v1 every
// process in its cgroup paths, then it removes them; kubelet kills what is
// left in the pod's cgroup in every hierarchy). A daemon in a cgroup below
// the mounter's container is killed with it at every restart and rollout.
// These leaves are below the host's cgroup roots instead:
//
//	<hierarchy>/mountplan-daemons/<instance>/          v1: every hierarchy the mounter is in below its root, memory, cpu and pids
//	<cgroup2>/mountplan-daemons/<instance>/daemons/    v2 (and a hybrid host's unified hierarchy), as Setup's layout
//	                                        <volume>/  one volume's daemon
//
// <instance> is the caller's name for its mounter (the mounter derives it
// from the device and inode of its records directory, which every later
// mounter of the node finds again), so that two mounters sharing a host's
// cgroup file system (a test cluster's nodes) never touch each other's
// leaves. Every path is built from the
// mount table of the mounter's own namespace and names it chose; nothing
// of a request is in them.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// OutsideDir is the directory below each hierarchy's root that holds the
// mounters' instances.
const OutsideDir = "mountplan-daemons"

// v1Hier is one cgroup v1 hierarchy the daemons get a leaf in.
type v1Hier struct {
	controllers []string // "memory"; "cpu", "cpuacct"; "name=systemd"
	base        string   // <mount>/mountplan-daemons/<instance>
}

func (h v1Hier) has(c string) bool { return slices.Contains(h.controllers, c) }

// SetupOutside lays the daemons' cgroups out outside the calling
// process's, below hostFS (the host's cgroup file system, its hierarchies
// mounted whole below it, as the host's /sys/fs/cgroup): on a cgroup v2
// host as Setup does below <hostFS>/mountplan-daemons/<instance>; on a v1
// or hybrid host in each v1 hierarchy in which the calling process is
// below the root, and in memory and cpu for the profiles' limits (and in
// the unified hierarchy of a hybrid host when the process is below its
// root there). A daemon started with its Leaf (V1 joined by the forking
// thread, Unified by CLONE_INTO_CGROUP) is in none of the caller's
// cgroups.
func SetupOutside(hostFS, instance string) (*Manager, error) {
	if err := checkName(instance); err != nil {
		return nil, err
	}
	// A mount point in the mount table is clean: "/sys/fs/cgroup/" would
	// match none below it.
	hostFS = filepath.Clean(hostFS)
	var made []string
	m, err := setupOutside(hostFS, instance, &made)
	if err != nil {
		// What this call made is removed again, innermost first: a
		// failure halfway leaves no empty levels in the host's
		// hierarchies. A directory that existed before (another volume's
		// or mounter's) is not touched.
		for i := len(made) - 1; i >= 0; i-- {
			_ = unix.Rmdir(made[i])
		}
		return nil, err
	}
	return m, nil
}

// setupOutside is SetupOutside, adding to made each directory it makes.
func setupOutside(hostFS, instance string, made *[]string) (*Manager, error) {
	// The daemons/ and mounter/ levels of an instance this call made
	// (v2): removed with it on failure.
	v2Levels := func(base string) {
		if slices.Contains(*made, base) {
			*made = append(*made, filepath.Join(base, "mounter"), filepath.Join(base, "daemons"))
		}
	}
	if isCgroup2(hostFS) == nil {
		base, err := mkdirLevels(hostFS, instance, false, made)
		if err != nil {
			return nil, err
		}
		v2Levels(base)
		// The controllers pass down from the root to the instance's
		// children; where they cannot, Setup says AccountingOnly.
		enableOutside(filepath.Join(hostFS, OutsideDir))
		m, err := Setup(base)
		if err != nil {
			return nil, err
		}
		m.outside = []string{base, filepath.Dir(base)}
		return m, nil
	}
	own, err := readOwn()
	if err != nil {
		return nil, err
	}
	mounts, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		in := i.Mountpoint == hostFS || strings.HasPrefix(i.Mountpoint, hostFS+"/")
		return !in || (i.FSType != "cgroup" && i.FSType != "cgroup2") || i.Root != "/", false
	})
	if err != nil {
		return nil, err
	}
	m := &Manager{}
	for _, line := range own {
		id, ctrls, path := line[0], line[1], line[2]
		if id == "0" {
			if path == "/" {
				continue
			}
			i := slices.IndexFunc(mounts, func(i *mountinfo.Info) bool { return i.FSType == "cgroup2" })
			if i < 0 {
				return nil, fmt.Errorf("the unified cgroup hierarchy is not mounted below %s", hostFS)
			}
			base, err := mkdirLevels(mounts[i].Mountpoint, instance, false, made)
			if err != nil {
				return nil, err
			}
			v2Levels(base)
			m.base = base
			if err := m.enable(); err != nil {
				return nil, err
			}
			m.outside = append(m.outside, base, filepath.Dir(base))
			continue
		}
		names := strings.Split(ctrls, ",")
		// A hierarchy the process is at the root of holds nothing of its
		// container's; memory, cpu and pids are still wanted for the
		// leaves' bounds.
		if path == "/" && !slices.Contains(names, "memory") && !slices.Contains(names, "cpu") && !slices.Contains(names, "pids") {
			continue
		}
		i := slices.IndexFunc(mounts, func(i *mountinfo.Info) bool {
			if i.FSType != "cgroup" {
				return false
			}
			opts := strings.Split(i.VFSOptions, ",")
			for _, n := range names {
				if !slices.Contains(opts, n) {
					return false
				}
			}
			return true
		})
		if i < 0 {
			return nil, fmt.Errorf("the cgroup v1 hierarchy %s is not mounted below %s", ctrls, hostFS)
		}
		base, err := mkdirLevels(mounts[i].Mountpoint, instance, true, made)
		if err != nil {
			return nil, err
		}
		m.v1 = append(m.v1, v1Hier{controllers: names, base: base})
		m.outside = append(m.outside, base, filepath.Dir(base))
	}
	if m.base == "" && len(m.v1) == 0 {
		return nil, fmt.Errorf("no cgroup hierarchy below %s to put the daemons in", hostFS)
	}
	if len(m.v1) > 0 {
		var missing []string
		for _, c := range controllers {
			if !slices.ContainsFunc(m.v1, func(h v1Hier) bool { return h.has(c) }) {
				missing = append(missing, c)
			}
		}
		// The v1 hierarchies limit; a hybrid host's unified one (no
		// controllers) only holds the daemon outside the container's.
		m.v2Limits = false
		m.mode, m.reason = Enforced, ""
		if len(missing) > 0 {
			m.mode = AccountingOnly
			m.reason = fmt.Sprintf("the %s cgroup v1 controllers are not mounted below %s", strings.Join(missing, " and "), hostFS)
		}
	}
	return m, nil
}

// readOwn reads /proc/self/cgroup: id, controllers, path of each line.
func readOwn() ([][3]string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	var out [][3]string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 {
			out = append(out, [3]string{f[0], f[1], filepath.Clean("/" + f[2])})
		}
	}
	return out, nil
}

// mkdirLevels makes <root>/mountplan-daemons/<instance> (v1: each with the
// cpuset of its parent, which a new v1 cpuset lacks) and returns it; made,
// if not nil, gets each directory that did not exist before.
func mkdirLevels(root, instance string, v1 bool, made *[]string) (string, error) {
	dir := root
	for _, name := range []string{OutsideDir, instance} {
		dir = filepath.Join(dir, name)
		_, err := os.Lstat(dir)
		isNew := errors.Is(err, fs.ErrNotExist)
		if err := mkdirCgroup(dir, v1); err != nil {
			if isNew && made != nil {
				*made = append(*made, dir) // made, and its cpuset failed
			}
			return "", err
		}
		if isNew && made != nil {
			*made = append(*made, dir)
		}
	}
	return dir, nil
}

// mkdirCgroup makes dir (an existing one is reused); a v1 cpuset gets its
// parent's cpus and mems: a task cannot join a cpuset without them.
func mkdirCgroup(dir string, v1 bool) error {
	if err := mkdir(dir); err != nil {
		return err
	}
	if !v1 {
		return nil
	}
	for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if errors.Is(err, os.ErrNotExist) {
			return nil // not the cpuset hierarchy
		}
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(b)) != "" {
			continue
		}
		p, err := os.ReadFile(filepath.Join(filepath.Dir(dir), f))
		if err != nil {
			return err
		}
		if err := write(dir, f, strings.TrimSpace(string(p))); err != nil {
			return err
		}
	}
	return nil
}

// v1Leaves are name's directories in the v1 hierarchies.
func (m *Manager) v1Leaves(name string) []string {
	var out []string
	for _, h := range m.v1 {
		out = append(out, filepath.Join(h.base, name))
	}
	return out
}

// prepareV1 makes name's v1 leaves with the limits l (memory, cpu and
// pids).
func (m *Manager) prepareV1(name string, l Limits) ([]string, error) {
	var dirs []string
	for _, h := range m.v1 {
		dir := filepath.Join(h.base, name)
		// The levels above may have been removed by the teardown of the
		// last other volume (or by another mounter sharing the host's
		// cgroups) meanwhile, also between two of these: made again.
		var err error
		for range 3 {
			if err = mkdirLeaf(dir); !errors.Is(err, unix.ENOENT) {
				break
			}
		}
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, dir)
		if h.has("memory") {
			limit := "-1"
			if l.MemoryBytes > 0 {
				limit = strconv.FormatInt(l.MemoryBytes, 10)
			}
			// No swap beyond the limit, where swap is accounted. The
			// kernel wants memsw >= the memory limit at every write: a
			// reused leaf's memsw is lifted first.
			_, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes"))
			memsw := err == nil
			if memsw {
				_ = write(dir, "memory.memsw.limit_in_bytes", "-1")
			}
			if err := write(dir, "memory.limit_in_bytes", limit); err != nil {
				return dirs, err
			}
			if memsw {
				if err := write(dir, "memory.memsw.limit_in_bytes", limit); err != nil {
					return dirs, err
				}
			}
		}
		if h.has("pids") {
			if err := write(dir, "pids.max", l.pidsMax()); err != nil {
				return dirs, err
			}
		}
		if h.has("cpu") {
			quota := "-1"
			if l.CPUMilli > 0 {
				quota = strconv.FormatInt(l.CPUMilli*Period/1000, 10)
			}
			if err := write(dir, "cpu.cfs_period_us", strconv.Itoa(Period)); err != nil {
				return dirs, err
			}
			if err := write(dir, "cpu.cfs_quota_us", quota); err != nil {
				return dirs, err
			}
		}
	}
	return dirs, nil
}

// usageV1 reads name's v1 leaves into u.
func (m *Manager) usageV1(name string, u *Usage) error {
	var found bool
	for _, h := range m.v1 {
		dir := filepath.Join(h.base, name)
		if h.has("memory") {
			b, err := os.ReadFile(filepath.Join(dir, "memory.usage_in_bytes"))
			if err != nil {
				return err
			}
			found = true
			u.MemoryBytes, _ = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
			u.HasMemory = true
			if b, err := os.ReadFile(filepath.Join(dir, "memory.limit_in_bytes")); err == nil {
				// No limit reads as a page-rounded huge number.
				if v, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); v < 1<<62 {
					u.MemoryMax = v
				}
			}
			if ev, err := readKeyed(filepath.Join(dir, "memory.oom_control")); err == nil {
				u.OOMKills = ev["oom_kill"]
			}
		}
		if h.has("cpuacct") {
			if b, err := os.ReadFile(filepath.Join(dir, "cpuacct.usage")); err == nil {
				found = true
				ns, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
				u.CPUUsec = ns / 1000
			}
		}
	}
	if !found && m.base == "" {
		return os.ErrNotExist
	}
	return nil
}

// procsV1 lists the processes in name's v1 leaves.
func (m *Manager) procsV1(name string) []string {
	var pids []string
	for _, dir := range m.v1Leaves(name) {
		p, _ := readLines(filepath.Join(dir, "cgroup.procs"))
		pids = append(pids, p...)
	}
	return pids
}

// removeLeaves removes name's leaves (v1 and v2).
func (m *Manager) removeLeaves(name string) error {
	var errs []error
	for _, dir := range m.v1Leaves(name) {
		if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, &os.PathError{Op: "rmdir", Path: dir, Err: err})
		}
	}
	if m.base != "" {
		if err := unix.Rmdir(m.Path(name)); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, &os.PathError{Op: "rmdir", Path: m.Path(name), Err: err})
		}
	}
	return errors.Join(errs...)
}

// RemoveEmptyLevels removes the instance's directories when no leaf is
// left in them (outside managers only; best effort: another volume or
// mounter may still use them).
func (m *Manager) RemoveEmptyLevels() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.removeEmptyLevels()
}

// removeEmptyLevels is RemoveEmptyLevels with m.mu held.
func (m *Manager) removeEmptyLevels() {
	if m.base != "" && len(m.outside) > 0 {
		_ = unix.Rmdir(m.daemons())
	}
	for _, d := range m.outside {
		_ = unix.Rmdir(d)
	}
}

// Outside says whether the daemons' cgroups are outside the caller's.
func (m *Manager) Outside() bool { return len(m.outside) > 0 }

// ensureOutside makes an outside manager's v2 levels again after
// RemoveEmptyLevels removed them (the last volume was torn down); m.mu is
// held from here to the leaf's mkdir.
func (m *Manager) ensureOutside() error {
	if len(m.outside) == 0 || m.base == "" {
		return nil
	}
	if _, err := os.Stat(m.daemons()); err == nil {
		return nil
	}
	root := filepath.Dir(filepath.Dir(m.base))
	var err error
	for range 3 { // another mounter may remove the shared level meanwhile
		if _, err = mkdirLevels(root, filepath.Base(m.base), false, nil); !errors.Is(err, unix.ENOENT) {
			break
		}
	}
	if err != nil {
		return err
	}
	if m.v2Limits || m.v2Pids {
		enableOutside(filepath.Join(root, OutsideDir))
	}
	mode, reason := m.mode, m.reason
	err = m.enable()
	if len(m.v1) > 0 {
		m.mode, m.reason = mode, reason // a hybrid host: the v1 hierarchies limit
	}
	return err
}

// enableOutside turns the controllers on for the children of the shared
// mountplan-daemons/ level, best effort: memory and cpu together (Setup
// then finds whether they reached the instance), pids on its own, so that
// a hierarchy without pids still gets memory and cpu.
func enableOutside(dir string) {
	_ = write(dir, "cgroup.subtree_control", "+memory +cpu")
	_ = write(dir, "cgroup.subtree_control", "+pids")
}

// mkdirLeaf makes a v1 leaf and the two levels above it.
func mkdirLeaf(dir string) error {
	for _, d := range []string{filepath.Dir(filepath.Dir(dir)), filepath.Dir(dir), dir} {
		if err := mkdirCgroup(d, true); err != nil {
			return err
		}
	}
	return nil
}
