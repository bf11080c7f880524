package e2e

// Helpers of the TestPrepare* tests (prepare-not-publish): the consumers the
// journal records, and views of the kernel that do not go through the
// product (/proc/*/mountinfo, /sys/block/loop*). The plugin, the sidecar and
// the journal's files are the shared harness's (env_test.go).

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/test/testutil"
)

// wantConsumer checks that the journal records exactly one consumer of id:
// pid's mount namespace (by inode, not only by PID) at mountPoint.
func (e *env) wantConsumer(id string, pid int, mountPoint string) model.Claim {
	e.t.Helper()
	cs := e.consumers(id)
	if len(cs) != 1 {
		e.t.Fatalf("journal: volume %s has %d consumers, want 1: %+v", id, len(cs), cs)
	}
	c := cs[0]
	ino := prepNSInode(e.t, pid)
	if c.PID != pid || c.MountPoint != mountPoint || c.Namespace.Inode != ino {
		e.t.Fatalf("journal: consumer %+v, want pid %d mnt ns %d at %s", c, pid, ino, mountPoint)
	}
	return c
}

func (e *env) wantNoConsumer(id string) {
	e.t.Helper()
	if cs := e.consumers(id); len(cs) != 0 {
		e.t.Errorf("journal: volume %s still records consumers %+v", id, cs)
	}
}

// --- the kernel's view ---

// prepDev is a loop device: its node and number.
type prepDev struct {
	Path         string // /dev/loopN
	Major, Minor uint32
}

func (d prepDev) name() string { return filepath.Base(d.Path) }

func (d prepDev) String() string { return fmt.Sprintf("%s (%d:%d)", d.Path, d.Major, d.Minor) }

func prepDevOf(t *testing.T, path string) prepDev {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("%s is not a block device", path)
	}
	return prepDev{Path: path, Major: unix.Major(uint64(st.Rdev)), Minor: unix.Minor(uint64(st.Rdev))} //nolint:unconvert
}

// stagedDevice returns the loop device of a staged volume and checks, in
// sysfs, that it is backed by image.
func (e *env) stagedDevice(id, image string) prepDev {
	e.t.Helper()
	st := e.loopState(id)
	d := prepDevOf(e.t, st.Device)
	if got := loopBackingFile(d.name()); got != image {
		e.t.Fatalf("%s is backed by %q, want %q", d, got, image)
	}
	return d
}

// prepMountsOfDev returns the mounts in pid's mount table that show d: a
// filesystem on it (its major:minor, or its path as the source) or a bind
// of its device node (a devtmpfs mount whose root is the node).
func prepMountsOfDev(pid int, d prepDev) ([]string, error) {
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, mi := range infos {
		if (uint32(mi.Major) == d.Major && uint32(mi.Minor) == d.Minor) || mi.Source == d.Path ||
			(mi.Root == "/"+d.name() && mi.FSType == "devtmpfs") {
			out = append(out, fmt.Sprintf("%s (%s %s %d:%d root %s)", mi.Mountpoint, mi.FSType, mi.Source, mi.Major, mi.Minor, mi.Root))
		}
	}
	return out, nil
}

// prepHostMountsOfDev: the test runs in the host's mount namespace, as does
// the plugin; /proc/self/mountinfo is the host's table.
func prepHostMountsOfDev(t *testing.T, d prepDev) []string {
	t.Helper()
	out, err := prepMountsOfDev(os.Getpid(), d)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// prepCheckHostClean fails t if the host namespace shows d mounted.
func prepCheckHostClean(t *testing.T, when string, d prepDev) {
	t.Helper()
	if m := prepHostMountsOfDev(t, d); len(m) > 0 {
		t.Errorf("%s: the host's /proc/self/mountinfo shows %s mounted: %v", when, d, m)
	}
}

// prepNamespacesShowing returns, per mount namespace, a live process of it
// whose mount table shows d.
func prepNamespacesShowing(d prepDev) map[string]int {
	out := map[string]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ns, err := testutil.MountNamespaceOf(pid)
		if err != nil {
			continue
		}
		if _, seen := out[ns]; seen {
			continue
		}
		if m, err := prepMountsOfDev(pid, d); err == nil && len(m) > 0 {
			out[ns] = pid
		}
	}
	return out
}

// prepNSInode returns the inode of pid's mount namespace.
func prepNSInode(t *testing.T, pid int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/mnt", pid), &st); err != nil {
		t.Fatalf("mount namespace of %d: %v", pid, err)
	}
	return st.Ino
}

// prepMountAt returns the mount at mountPoint in pid's table (the topmost
// one), or nil.
func prepMountAt(t *testing.T, pid int, mountPoint string) *mountinfo.Info {
	t.Helper()
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	var top *mountinfo.Info
	for _, mi := range infos {
		if mi.Mountpoint == mountPoint {
			top = mi
		}
	}
	return top
}

// prepWatch polls the host's mount table in the background for as long as
// the test runs and records every mount that bad says must not be there:
// "never" checked continuously, not only at chosen points.
type prepWatch struct {
	mu    sync.Mutex
	seen  map[string]bool
	polls int
	once  sync.Once
	stop  chan struct{}
	done  chan struct{}
}

func prepWatchHost(t *testing.T, what string, bad func(*mountinfo.Info) bool) *prepWatch {
	w := &prepWatch{seen: map[string]bool{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			infos, err := mountinfo.GetMounts(nil)
			w.mu.Lock()
			w.polls++
			if err == nil {
				for _, mi := range infos {
					if bad(mi) {
						w.seen[fmt.Sprintf("%s (%s %s %d:%d %s)", mi.Mountpoint, mi.FSType, mi.Source, mi.Major, mi.Minor, mi.VFSOptions)] = true
					}
				}
			}
			w.mu.Unlock()
			select {
			case <-w.stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { w.check(t, what) })
	return w
}

// check stops the watch and fails t if it saw anything. Only the first
// call checks.
func (w *prepWatch) check(t *testing.T, what string) {
	t.Helper()
	first := false
	w.once.Do(func() { first = true; close(w.stop) })
	if !first {
		return
	}
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.seen) > 0 {
		var l []string
		for s := range w.seen {
			l = append(l, s)
		}
		t.Errorf("the host's mount table showed %s during the test: %v", what, l)
	} else {
		t.Logf("host mount table polled %d times: never showed %s", w.polls, what)
	}
}

func prepDevWatch(t *testing.T, d prepDev) *prepWatch {
	return prepWatchHost(t, d.String()+" mounted", func(mi *mountinfo.Info) bool {
		return (uint32(mi.Major) == d.Major && uint32(mi.Minor) == d.Minor) || mi.Source == d.Path ||
			(mi.Root == "/"+d.name() && mi.FSType == "devtmpfs")
	})
}

// --- small things ---

// prepNoPID returns a PID that no process has.
func prepNoPID(t *testing.T) int {
	t.Helper()
	max := 4194304
	if b, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			max = n
		}
	}
	for pid := max - 1; pid > max-1000; pid-- {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, fs.ErrNotExist) {
			return pid
		}
	}
	t.Fatal("no free PID found")
	return 0
}

// prepTimed logs the steps of a test with the time since it started.
type prepTimed struct {
	t     *testing.T
	start time.Time
}

func prepTimer(t *testing.T) *prepTimed { return &prepTimed{t: t, start: time.Now()} }

func (p *prepTimed) step(name string) {
	p.t.Helper()
	p.t.Logf("== %s (at %v)", name, time.Since(p.start).Round(time.Millisecond))
}
