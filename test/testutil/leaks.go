package testutil

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// DefaultLeakWait bounds how long CheckNoLeaks waits for the system to
// return to its state before the test. Some teardown is asynchronous: the
// kernel drops a dead mount namespace's mounts (and the loop devices they
// held) after the last process in it has been reaped, not at once.
const DefaultLeakWait = 5 * time.Second

// LoopDevice is an attached loop device.
type LoopDevice struct {
	Name        string // "loop3"
	BackingFile string // as the kernel reports it, " (deleted)" included
}

// Mount is one line of the test process's /proc/self/mountinfo. Two mounts
// are the same when MountPoint, Source and FSType match.
type Mount struct {
	MountPoint string
	Source     string
	FSType     string
	Dev        string // "major:minor", informational only
}

func (m Mount) key() string { return m.MountPoint + "\x00" + m.Source + "\x00" + m.FSType }

// Snapshot is the part of the system state that a test must leave as it
// found it.
type Snapshot struct {
	Loops     []LoopDevice     // /sys/block/loop*/loop/backing_file
	Mounts    []Mount          // /proc/self/mountinfo (the test's own mount namespace)
	FuseConns []string         // /sys/fs/fuse/connections/*
	Procs     map[int]ProcInfo // /proc/[0-9]*
	Errs      []error          // what could not be read
}

// TakeSnapshot records the loop devices, mounts, FUSE connections and
// processes that exist now.
func TakeSnapshot() Snapshot {
	var s Snapshot
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached while we looked
		}
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		s.Loops = append(s.Loops, LoopDevice{Name: name, BackingFile: strings.TrimSpace(string(b))})
	}
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		s.Errs = append(s.Errs, fmt.Errorf("reading /proc/self/mountinfo: %w", err))
	}
	for _, mi := range infos {
		s.Mounts = append(s.Mounts, Mount{
			MountPoint: mi.Mountpoint,
			Source:     mi.Source,
			FSType:     mi.FSType,
			Dev:        fmt.Sprintf("%d:%d", mi.Major, mi.Minor),
		})
	}
	conns, err := fuseConnections(s.Mounts)
	if err != nil {
		s.Errs = append(s.Errs, err)
	}
	s.FuseConns = conns
	s.Procs = readProcs()
	return s
}

const fusectlDir = "/sys/fs/fuse/connections"

// fuseConnections lists the FUSE connections. fusectl need not be mounted
// on the host (it is not on the CI machine): then it is mounted in a
// throwaway mount namespace, by a child process, so that the host's mounts
// stay as they are (a Go thread in another namespace would be fragile: if
// it were the main thread, /proc/self would show that namespace).
func fuseConnections(mounts []Mount) ([]string, error) {
	for _, m := range mounts {
		if m.FSType == "fusectl" && m.MountPoint == fusectlDir {
			ents, err := os.ReadDir(fusectlDir)
			if err != nil {
				return nil, err
			}
			var conns []string
			for _, e := range ents {
				conns = append(conns, e.Name())
			}
			return conns, nil
		}
	}
	if _, err := os.Stat(fusectlDir); err != nil || os.Geteuid() != 0 {
		return nil, nil // no FUSE here, or no way to look
	}
	out, err := withFusectl("ls -1 " + fusectlDir)
	if err != nil {
		return nil, fmt.Errorf("listing FUSE connections: %w", err)
	}
	return strings.Fields(out), nil
}

// withFusectl runs a shell script in a throwaway mount namespace in which
// fusectl is mounted on /sys/fs/fuse/connections.
func withFusectl(script string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return runCmd(ctx, "unshare", "--mount", "--propagation", "private", "sh", "-c",
		"mount -t fusectl fusectl "+fusectlDir+" && "+script)
}

// abortFuse aborts FUSE connection conn, if it still exists: its requests
// fail and its daemon is cut off. Unmounting usually removes it first.
func abortFuse(conn string) error {
	if _, err := strconv.Atoi(conn); err != nil {
		return fmt.Errorf("bad FUSE connection %q", conn)
	}
	f := fusectlDir + "/" + conn + "/abort"
	_, err := withFusectl("if [ -e " + f + " ]; then echo 1 > " + f + "; fi")
	return err
}

// Leak is something that exists after a test and did not before it.
type Leak struct {
	Kind string // "loop device", "mount", "FUSE connection" or "process"
	What string
	// reclaim undoes the leak; nil when the leak is not provably the
	// test's own (outside every path marker) and so is left alone.
	reclaim func() error
	order   int  // reclaim order: processes, mounts (deepest first), FUSE, loops
	zombie  bool // a process that has exited but was not waited for
}

func (l Leak) String() string { return l.Kind + ": " + l.What }

// leakMarkers are registered by helpers for the whole test binary: unique
// temporary directories whose paths appear in the command lines of the
// processes the helpers start.
var leakMarkers struct {
	sync.Mutex
	list []string
}

// RegisterLeakMarker makes every later leak check track processes whose
// command line contains marker (and their descendants), even when they are
// not descendants of the test process. When marker is an absolute path,
// leaked mounts under it and leaked loop devices backed by files under it
// are also cleaned up after being reported.
func RegisterLeakMarker(marker string) {
	if marker == "" {
		return
	}
	leakMarkers.Lock()
	defer leakMarkers.Unlock()
	leakMarkers.list = append(leakMarkers.list, marker)
}

// MarkedTempDir makes a temporary directory prefix* directly under the
// system's temp dir (short: the paths of sockets in it must fit in 108
// bytes) and registers it as a leak marker (RegisterLeakMarker). The caller
// removes it, once what runs there has stopped.
func MarkedTempDir(t testing.TB, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	RegisterLeakMarker(dir)
	return dir
}

// added returns what after holds more of than before, by key: a thing
// that stands twice after and once before is added once.
func added[T any, K comparable](before, after []T, key func(T) K) []T {
	count := map[K]int{}
	for _, x := range before {
		count[key(x)]++
	}
	var out []T
	for _, x := range after {
		if k := key(x); count[k] > 0 {
			count[k]--
			continue
		}
		out = append(out, x)
	}
	return out
}

func allMarkers(extra []string) []string {
	leakMarkers.Lock()
	defer leakMarkers.Unlock()
	var out []string
	for _, m := range append(append([]string(nil), leakMarkers.list...), extra...) {
		if m != "" {
			out = append(out, m)
		}
	}
	return out
}

// FindLeaks compares two snapshots. It reports every loop device, mount and
// FUSE connection in after that is not in before, and every new process
// that is still alive and is the test process's descendant, or whose
// command line contains one of markers (or a registered marker), or
// descends from such a process. Kernel threads and the Go toolchain are
// ignored; a zombie counts only when the test process is its parent (it
// was started and never waited for).
func FindLeaks(before, after Snapshot, markers ...string) []Leak {
	markers = allMarkers(markers)
	var owned []string // absolute path markers: what lies under them is the test's own
	for _, m := range markers {
		if filepath.IsAbs(m) && len(m) > 1 {
			owned = append(owned, filepath.Clean(m))
		}
	}
	isOwned := func(p string) bool {
		for _, r := range owned {
			if p == r || strings.HasPrefix(p, r+"/") {
				return true
			}
		}
		return false
	}

	var leaks []Leak

	for _, l := range added(before.Loops, after.Loops, func(l LoopDevice) LoopDevice { return l }) {
		lk := Leak{Kind: "loop device", What: "/dev/" + l.Name + " backed by " + l.BackingFile, order: 3000}
		if isOwned(strings.TrimSuffix(l.BackingFile, " (deleted)")) {
			lk.reclaim = func() error { return detachLoop(l) }
		}
		leaks = append(leaks, lk)
	}

	for _, m := range added(before.Mounts, after.Mounts, Mount.key) {
		lk := Leak{Kind: "mount", What: fmt.Sprintf("%s (type %s, source %s)", m.MountPoint, m.FSType, m.Source),
			order: 1000 - strings.Count(m.MountPoint, "/")}
		if isOwned(m.MountPoint) {
			mp := m.MountPoint
			lk.reclaim = func() error { return unix.Unmount(mp, unix.MNT_DETACH) }
		}
		leaks = append(leaks, lk)
	}

	for _, c := range added(before.FuseConns, after.FuseConns, func(c string) string { return c }) {
		lk := Leak{Kind: "FUSE connection", What: c, order: 2000}
		for _, m := range after.Mounts {
			if m.Dev == "0:"+c && strings.HasPrefix(m.FSType, "fuse") {
				lk.What += " (mounted at " + m.MountPoint + ", type " + m.FSType + ")"
				if isOwned(m.MountPoint) {
					lk.reclaim = func() error { return abortFuse(c) }
				}
			}
		}
		leaks = append(leaks, lk)
	}

	self := os.Getpid()
	related := func(p ProcInfo) bool {
		seen := map[int]bool{}
		for q, ok := p, true; ok && !seen[q.PID]; q, ok = after.Procs[q.PPID] {
			seen[q.PID] = true
			if q.PID == self {
				return true
			}
			for _, m := range markers {
				if strings.Contains(q.Cmdline, m) {
					return true
				}
			}
		}
		return false
	}
	var pids []int
	for pid := range after.Procs {
		pids = append(pids, pid)
	}
	sort.Ints(pids)
	for _, pid := range pids {
		p := after.Procs[pid]
		if old, ok := before.Procs[pid]; ok && old.StartTime == p.StartTime {
			continue
		}
		if pid == self || isKernelThread(p) || !related(p) {
			continue
		}
		if p.State == 'Z' && p.PPID != self {
			continue // its parent reaps it
		}
		if isGoToolchain(pid) {
			continue
		}
		lk := Leak{Kind: "process", What: p.String(), zombie: p.State == 'Z'}
		if p.State != 'Z' {
			lk.reclaim = func() error {
				if !alive(p.PID, p.StartTime) {
					return nil
				}
				return unix.Kill(p.PID, unix.SIGKILL)
			}
		}
		leaks = append(leaks, lk)
	}
	sort.SliceStable(leaks, func(i, j int) bool { return leaks[i].order < leaks[j].order })
	return leaks
}

func detachLoop(l LoopDevice) error {
	f, err := os.OpenFile("/dev/"+l.Name, os.O_RDONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// Make sure the number still names the same device: loop numbers are
	// reused within milliseconds.
	b, err := os.ReadFile("/sys/block/" + l.Name + "/loop/backing_file")
	if err != nil || strings.TrimSpace(string(b)) != l.BackingFile {
		return nil
	}
	// While the device is still open elsewhere (mounted), LOOP_CLR_FD sets
	// autoclear instead, and the kernel detaches it at the last close.
	return unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
}

// WaitNoLeaks takes snapshots until none differs from before (see
// FindLeaks), for at most wait, and returns the leaks of the last one.
func WaitNoLeaks(before Snapshot, wait time.Duration, markers ...string) []Leak {
	var leaks []Leak
	Poll(wait, 50*time.Millisecond, func() bool {
		leaks = FindLeaks(before, TakeSnapshot(), markers...)
		return len(leaks) == 0
	})
	return leaks
}

// CheckNoLeaks fails t, listing each leak, unless the system returns to the
// state recorded in before within DefaultLeakWait (see FindLeaks for what
// counts). The test's own leaks (under an absolute path marker, or
// processes) are then cleaned up so that they do not spill into later
// tests; what remains after that is logged.
func CheckNoLeaks(t testing.TB, before Snapshot, markers ...string) {
	t.Helper()
	for _, err := range before.Errs {
		t.Errorf("leak check: snapshot before the test incomplete: %v", err)
	}
	leaks := WaitNoLeaks(before, DefaultLeakWait, markers...)
	if len(leaks) == 0 {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "leaked: %d item(s) still present %v after the test and its cleanups:", len(leaks), DefaultLeakWait)
	for _, l := range leaks {
		b.WriteString("\n\t" + l.String())
	}
	t.Errorf("%s", b.String())

	reclaimed := 0
	for _, l := range leaks {
		if l.reclaim == nil {
			continue
		}
		if err := l.reclaim(); err != nil {
			t.Logf("leak check: could not clean up %s: %v", l, err)
		}
		reclaimed++
	}
	if reclaimed == 0 {
		return
	}
	// Killed children of the test stay zombies until the test waits for
	// them: they are dead, which is all that cleaning up can do.
	var rest []Leak
	Poll(DefaultLeakWait, 50*time.Millisecond, func() bool {
		rest = rest[:0]
		for _, l := range FindLeaks(before, TakeSnapshot(), markers...) {
			if !l.zombie {
				rest = append(rest, l)
			}
		}
		return len(rest) == 0
	})
	if len(rest) > 0 {
		b.Reset()
		b.WriteString("leak check: still present after cleaning up:")
		for _, l := range rest {
			b.WriteString("\n\t" + l.String())
		}
		t.Logf("%s", b.String())
	}
}

// NoLeaks makes t fail if, once all its cleanups have run, a loop device,
// mount, FUSE connection or process (see FindLeaks) exists that did not
// exist when NoLeaks was called. Call it first in the test, before
// anything registers a cleanup, so that its check runs last.
//
// The test's temporary directory (the parent of every t.TempDir()) is
// always a marker; markers adds more. NoLeaks serialises the tests that use
// it, across test binaries too (go test runs packages in parallel), through
// a lock file in os.TempDir(): their snapshots are of the whole machine. A
// subtest of a test holding the lock may call NoLeaks too; parallel tests
// that both call it run one after the other. A parallel test must call
// t.Parallel before NoLeaks: paused while holding the lock, it would
// deadlock with the serial tests waiting for it.
//
// What the check finds is then cleaned up where it is provably the test's
// own (processes it tracks, mounts and loop devices under a path marker),
// so that one leaking test does not fail the next ones too.
func NoLeaks(t testing.TB, markers ...string) {
	t.Helper()
	unlock := lockRootTests(t)
	// t.TempDir registers its own removal now, so that it runs after the
	// check below: a leaked mount is unmounted before Go removes the
	// directory it sits in.
	markers = append([]string{filepath.Dir(t.TempDir())}, markers...)
	before := TakeSnapshot()
	t.Cleanup(func() {
		defer unlock()
		CheckNoLeaks(t, before, markers...)
	})
}

// RootTestLockPath is the lock file through which NoLeaks serialises
// tests across test binaries.
var RootTestLockPath = filepath.Join(os.TempDir(), "mountplan-root-tests.lock")

var rootLock = struct {
	mu     sync.Mutex
	cond   *sync.Cond
	holder string // name of the test holding the lock
	depth  int
	file   *os.File
}{}

func init() { rootLock.cond = sync.NewCond(&rootLock.mu) }

func lockRootTests(t testing.TB) (unlock func()) {
	t.Helper()
	name := t.Name()
	rootLock.mu.Lock()
	defer rootLock.mu.Unlock()
	logged := false
	for rootLock.holder != "" && !strings.HasPrefix(name, rootLock.holder+"/") {
		if !logged {
			t.Logf("leak check: waiting for %s to finish (root tests run one at a time)", rootLock.holder)
			logged = true
		}
		rootLock.cond.Wait()
	}
	if rootLock.holder == "" {
		// Read-only is enough for flock, and lets any user share the file.
		f, err := os.OpenFile(RootTestLockPath, os.O_RDONLY|os.O_CREATE, 0o666)
		if err != nil {
			t.Fatalf("leak check: %v", err)
		}
		_ = f.Chmod(0o666) // despite the umask, when the file is ours
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			t.Logf("leak check: waiting for another test process holding %s", RootTestLockPath)
			if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
				f.Close()
				t.Fatalf("leak check: locking %s: %v", RootTestLockPath, err)
			}
		}
		rootLock.holder, rootLock.file = name, f
	}
	rootLock.depth++
	var once sync.Once
	return func() {
		once.Do(func() {
			rootLock.mu.Lock()
			defer rootLock.mu.Unlock()
			rootLock.depth--
			if rootLock.depth == 0 {
				rootLock.file.Close() // releases the flock
				rootLock.holder, rootLock.file = "", nil
				rootLock.cond.Broadcast()
			}
		})
	}
}
