package cgroup

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// DefaultFS is where cgroup v2 is mounted on a unified host and in a
// container with a cgroup namespace of its own.
const DefaultFS = "/sys/fs/cgroup"

// Mode says what a Manager does for the daemons.
type Mode string

const (
	// Enforced: each daemon in a leaf of its own with the memory and
	// cpu controllers, its profile's limits applied.
	Enforced Mode = "enforced"
	// AccountingOnly: each daemon in a leaf of its own, but memory and
	// cpu are not available to the mounter's cgroup: CPU time is
	// accounted (cpu.stat), nothing is limited.
	AccountingOnly Mode = "accounting-only"
)

// controllers are those the daemons' leaves need.
var controllers = []string{"memory", "cpu"}

// Manager keeps the daemons' leaves below base. Its methods may be called
// from several goroutines (the mounter locks per volume only).
type Manager struct {
	// mu serializes the layout (the levels above the leaves, the leaves'
	// mkdir and rmdir, and mode, reason, v2Limits that ensureOutside
	// sets again): volume A's RemoveEmptyLevels would otherwise remove
	// daemons/ or <instance> between volume B's check in ensureOutside and
	// its mkdir. It is never held while a daemon starts or while a leaf
	// is waited for to empty.
	mu     sync.Mutex
	base   string // the v2 base ("": none, a v1 host's outside manager)
	mode   Mode
	reason string // why limits are not enforced (AccountingOnly)
	// v2Limits: memory and cpu are enabled for base's leaves.
	v2Limits bool
	// v2Pids: pids is enabled for base's leaves (pids.max), independent
	// of memory and cpu.
	v2Pids bool
	// v1 are the v1 hierarchies of an outside manager (outside_linux.go).
	v1 []v1Hier
	// outside are the directories an outside manager made above its
	// leaves, innermost first: removed when they are empty.
	outside []string
}

// Setup lays out base (see the package comment) and returns its Manager.
// An empty base is the calling process's own cgroup (/proc/self/cgroup)
// below DefaultFS. It fails on a host without cgroup v2 at DefaultFS (v1
// or hybrid), and where base cannot be written: the caller then runs
// daemons without cgroups of their own and says that limits are not
// enforced.
func Setup(base string) (*Manager, error) {
	if base == "" {
		own, err := ownCgroup(DefaultFS)
		if err != nil {
			return nil, err
		}
		base = own
	}
	if err := isCgroup2(base); err != nil {
		return nil, err
	}
	m := &Manager{base: base}
	// A process may be forked into base between the move and the enabling
	// (the write then fails EBUSY), and the kernel may answer EBUSY for a
	// moment after a move (crun retries for that too): move and enable
	// again a few times.
	var err error
	for i := 0; i < 10; i++ {
		if err = m.evacuate(); err != nil {
			return nil, err
		}
		if err = m.enable(); !errors.Is(err, unix.EBUSY) {
			break
		}
		time.Sleep(time.Duration(i+1) * 10 * time.Millisecond)
	}
	if err != nil {
		return nil, err
	}
	return m, nil
}

// ownCgroup is this process's cgroup v2 directory below the mount fsRoot.
func ownCgroup(fsRoot string) (string, error) {
	if err := isCgroup2(fsRoot); err != nil {
		return "", fmt.Errorf("%w (a cgroup v1 or hybrid host)", err)
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(fsRoot, filepath.Clean("/"+p)), nil
		}
	}
	return "", fmt.Errorf("/proc/self/cgroup names no cgroup v2 cgroup")
}

func isCgroup2(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return &os.PathError{Op: "statfs", Path: dir, Err: err}
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("%s is not a cgroup v2 file system", dir)
	}
	return nil
}

// evacuate moves every process of base into base/mounter: a cgroup that
// enables controllers for its children may hold no process itself. The
// root of a hierarchy is exempt (it has no cgroup.type), and is left as it
// is.
func (m *Manager) evacuate() error {
	if _, err := os.Stat(filepath.Join(m.base, "cgroup.type")); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	pids, err := readLines(filepath.Join(m.base, "cgroup.procs"))
	if err != nil || len(pids) == 0 {
		return err
	}
	leaf := filepath.Join(m.base, "mounter")
	if err := mkdir(leaf); err != nil {
		return err
	}
	for _, pid := range pids {
		// A process that exited meanwhile is ESRCH: nothing to move.
		if err := write(leaf, "cgroup.procs", pid); err != nil && !errors.Is(err, unix.ESRCH) {
			return err
		}
	}
	return nil
}

// enable turns memory and cpu on for base's and daemons/'s children when
// base has them; otherwise the leaves only account (AccountingOnly). pids
// is turned on where available.
func (m *Manager) enable() error {
	avail, err := readLines(filepath.Join(m.base, "cgroup.controllers"))
	if err != nil {
		return err
	}
	var missing []string
	for _, c := range controllers {
		if !slices.Contains(avail, c) {
			missing = append(missing, c)
		}
	}
	if err := mkdir(m.daemons()); err != nil {
		return err
	}
	// pids bounds a daemon that is outside the pod's pids limit; it is
	// enabled where it is available whatever memory and cpu are.
	if slices.Contains(avail, "pids") {
		m.v2Pids = true
		for _, dir := range []string{m.base, m.daemons()} {
			if err := write(dir, "cgroup.subtree_control", "+pids"); err != nil {
				return err
			}
		}
	}
	if len(missing) > 0 {
		m.mode = AccountingOnly
		m.reason = fmt.Sprintf("the %s controllers are not available to %s (cgroup.controllers: %q)",
			strings.Join(missing, " and "), m.base, strings.Join(avail, " "))
		return nil
	}
	on := "+memory +cpu"
	for _, dir := range []string{m.base, m.daemons()} {
		if err := write(dir, "cgroup.subtree_control", on); err != nil {
			return err
		}
	}
	m.mode, m.v2Limits = Enforced, true
	return nil
}

// Mode is what the manager does for the daemons.
func (m *Manager) Mode() Mode {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mode
}

// Reason says why limits are not enforced ("" when they are).
func (m *Manager) Reason() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.reason
}

// Base is the cgroup laid out for the daemons (a v1 host's outside
// manager: its directory in the first v1 hierarchy).
func (m *Manager) Base() string {
	if m.base == "" && len(m.v1) > 0 {
		return m.v1[0].base
	}
	return m.base
}

// Path is the directory of the leaf name: its v2 cgroup, or (a v1 host's
// outside manager) its cgroup in the first v1 hierarchy.
func (m *Manager) Path(name string) string {
	if m.base == "" {
		return filepath.Join(m.v1[0].base, name)
	}
	return filepath.Join(m.daemons(), name)
}

func (m *Manager) daemons() string { return filepath.Join(m.base, "daemons") }

// Leaf is a daemon's cgroup, ready for it.
type Leaf struct {
	// Path is the leaf's directory (Manager.Path).
	Path string
	// Unified is its cgroup v2 directory, if any (daemon.Command.Cgroup).
	Unified string
	// V1 are its directories in cgroup v1 hierarchies, if any
	// (daemon.Command.CgroupV1).
	V1 []string
	// Enforced: the limits are applied (false in AccountingOnly mode
	// when limits were asked for).
	Enforced bool
	// OOMKills is the leaf's count of OOM kills when it was prepared: a
	// later count above it means the daemon started then was killed.
	OOMKills uint64
}

// Prepare makes (or reuses: every generation of a volume's daemon shares
// one) the leaf name, one path component, with the limits l.
func (m *Manager) Prepare(name string, l Limits) (Leaf, error) {
	if err := checkName(name); err != nil {
		return Leaf{}, err
	}
	// Only directories and limit files: no daemon starts under the lock.
	m.mu.Lock()
	defer m.mu.Unlock()
	leaf := Leaf{Path: m.Path(name), Enforced: m.mode == Enforced || l.IsZero()}
	if len(m.v1) > 0 {
		dirs, err := m.prepareV1(name, l)
		leaf.V1 = dirs
		if err != nil {
			return leaf, err
		}
	}
	if m.base == "" {
		u, _ := m.Usage(name)
		leaf.OOMKills = u.OOMKills
		return leaf, nil
	}
	if err := m.ensureOutside(); err != nil {
		return leaf, err
	}
	dir := filepath.Join(m.daemons(), name)
	if err := mkdir(dir); err != nil {
		return leaf, err
	}
	leaf.Unified = dir
	if m.v2Pids {
		if err := write(dir, "pids.max", l.pidsMax()); err != nil {
			return leaf, err
		}
	}
	if m.v2Limits {
		if err := write(dir, "memory.max", l.memoryMax()); err != nil {
			return leaf, err
		}
		if _, err := os.Stat(filepath.Join(dir, "memory.swap.max")); err == nil {
			if err := write(dir, "memory.swap.max", "0"); err != nil {
				return leaf, err
			}
		}
		if err := write(dir, "cpu.max", l.cpuMax()); err != nil {
			return leaf, err
		}
	}
	u, _ := m.Usage(name)
	leaf.OOMKills = u.OOMKills
	return leaf, nil
}

func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("cgroup name %q is not one path component", name)
	}
	return nil
}

// Usage is what a leaf used, read at once from its files.
type Usage struct {
	// MemoryBytes is memory.current (HasMemory false: not accounted).
	MemoryBytes uint64
	HasMemory   bool
	// MemoryMax is memory.max in bytes (0: no limit, or not accounted).
	MemoryMax uint64
	// CPUUsec is cpu.stat's usage_usec.
	CPUUsec uint64
	// OOMKills is memory.events' oom_kill.
	OOMKills uint64
}

// Usage reads name's leaf; a leaf that is gone is fs.ErrNotExist.
func (m *Manager) Usage(name string) (Usage, error) {
	if err := checkName(name); err != nil {
		return Usage{}, err
	}
	var u Usage
	if len(m.v1) > 0 {
		if err := m.usageV1(name, &u); err != nil || m.base == "" {
			return u, err
		}
		if u.HasMemory {
			return u, nil // the v1 memory and cpuacct say it all
		}
	}
	dir := filepath.Join(m.daemons(), name)
	stat, err := readKeyed(filepath.Join(dir, "cpu.stat"))
	if err != nil {
		return u, err
	}
	u.CPUUsec = stat["usage_usec"]
	if b, err := os.ReadFile(filepath.Join(dir, "memory.current")); err == nil {
		u.MemoryBytes, _ = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		u.HasMemory = true
	}
	if b, err := os.ReadFile(filepath.Join(dir, "memory.max")); err == nil {
		u.MemoryMax, _ = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64) // "max": 0
	}
	if ev, err := readKeyed(filepath.Join(dir, "memory.events")); err == nil {
		u.OOMKills = ev["oom_kill"]
	}
	return u, nil
}

// Names lists the leaves below daemons/.
func (m *Manager) Names() ([]string, error) {
	dir := m.daemons()
	if m.base == "" {
		dir = m.v1[0].base
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// Populated says whether a process is left in name's leaf.
func (m *Manager) Populated(name string) bool {
	if len(m.procsV1(name)) > 0 {
		return true
	}
	if m.base == "" {
		return false
	}
	ev, err := readKeyed(filepath.Join(m.daemons(), name, "cgroup.events"))
	return err == nil && ev["populated"] != 0
}

// Kill kills every process left in name's leaf (cgroup.kill, Linux 5.14):
// a process that left the daemon's session is still in its cgroup. A
// kernel without cgroup.kill, or a leaf that is gone, is no error. The
// leaf is not for reuse afterwards (see KillProcs).
func (m *Manager) Kill(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	killAll(m.procsV1(name))
	if m.base == "" {
		return nil
	}
	err := write(filepath.Join(m.daemons(), name), "cgroup.kill", "1")
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// killAll sends SIGKILL to each of pids (not init, not this process).
func killAll(pids []string) {
	for _, p := range pids {
		if pid, err := strconv.Atoi(p); err == nil && pid > 1 && pid != os.Getpid() {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
}

// KillProcs kills every process in name's leaf one by one, until it is
// empty or timeout passes, and leaves the leaf usable. Not cgroup.kill:
// measured on Linux 6.18, every process later started into a leaf that
// once had cgroup.kill written (clone3 CLONE_INTO_CGROUP) is killed at
// once, so a leaf that a volume's next daemon will use is never killed
// that way.
func (m *Manager) KillProcs(ctx context.Context, name string, timeout time.Duration) error {
	if err := checkName(name); err != nil {
		return err
	}
	var last error
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		pids := m.procsV1(name)
		if m.base != "" {
			v2, err := readLines(filepath.Join(m.daemons(), name, "cgroup.procs"))
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				last = err
				return false, nil
			}
			pids = append(pids, v2...)
		}
		killAll(pids)
		return len(pids) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("processes left in %s: %w", m.Path(name), errors.Join(err, last))
	}
	return nil
}

// Remove kills what is left in name's leaf, waits up to timeout for it to
// be empty and removes it. A leaf that is gone is no error.
func (m *Manager) Remove(ctx context.Context, name string, timeout time.Duration) error {
	if err := m.Kill(name); err != nil {
		return err
	}
	_ = wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		return !m.Populated(name), nil
	})
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.removeLeaves(name); err != nil {
		return err
	}
	m.removeEmptyLevels()
	return nil
}

func mkdir(dir string) error {
	err := unix.Mkdir(dir, 0o755)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EEXIST) {
		return &os.PathError{Op: "mkdir", Path: dir, Err: err}
	}
	fi, serr := os.Lstat(dir)
	if serr != nil {
		return serr
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a cgroup directory", dir)
	}
	return nil
}

// write writes s to the interface file name of dir (one write, as the
// kernel wants it).
func write(dir, name, s string) error {
	p := filepath.Join(dir, name)
	f, err := os.OpenFile(p, os.O_WRONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", s, p, err)
	}
	return nil
}

// readLines reads the words of a file (cgroup.procs, cgroup.controllers).
func readLines(p string) ([]string, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(b)), nil
}

// readKeyed reads a flat keyed file ("key value" lines: cpu.stat,
// memory.events, cgroup.events).
func readKeyed(p string) (map[string]uint64, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out, nil
}
