//go:build linux

package cgrouptest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/daemon/cgroup"
)

// Limits the scenario asks for.
const (
	MemoryLimit = 32 << 20
	CPULimit    = 250 // millicores: cpu.max "25000 100000"
)

// Exercise runs the daemons' cgroup scenario in base, a cgroup of the
// test's own (Dedicated): a process already in base (the mounter) is
// moved to base/mounter; a leaf with limits is made; a daemon started in
// it lands there with its child; with the memory and cpu controllers
// (Enforced) the limits are in memory.max and cpu.max and a daemon that
// allocates past memory.max is OOM-killed and counted; without them the
// manager says why limits are not enforced; the leaves are removed,
// whatever is left in them killed. It returns the mode it found.
func Exercise(t *testing.T, base string) cgroup.Mode {
	fsRoot := FS()
	logDir := t.TempDir()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	spawn := func(name, cg, path string, args ...string) daemon.Proc {
		t.Helper()
		p, err := daemon.LocalSpawner{}.Spawn(context.Background(), daemon.Command{Path: path, Args: args,
			Log: filepath.Join(logDir, name+".log"), Cgroup: cg, Capabilities: []string{}})
		if err != nil {
			t.Fatalf("spawn %s in %s: %v", name, cg, err)
		}
		t.Cleanup(func() { _ = daemon.Terminate(context.Background(), p, 0) })
		return p
	}
	mounterProc := spawn("mounter", base, sleep, "60")
	m, err := cgroup.Setup(base)
	if err != nil {
		t.Fatalf("Setup(%s): %v", base, err)
	}
	if got := Of(fsRoot, mounterProc.PID); got != filepath.Join(base, "mounter") {
		t.Errorf("a process of the mounter's cgroup is in %s after Setup, want %s/mounter", got, base)
	}
	enforced := HasControllers(base)
	switch {
	case enforced && (m.Mode() != cgroup.Enforced || m.Reason() != ""):
		t.Errorf("memory and cpu available, but mode %s (%s)", m.Mode(), m.Reason())
	case !enforced && (m.Mode() != cgroup.AccountingOnly || !strings.Contains(m.Reason(), "memory")):
		t.Errorf("memory and cpu not available, but mode %s, reason %q", m.Mode(), m.Reason())
	}
	if enforced {
		if sc := Read(t, base, "cgroup.subtree_control"); !strings.Contains(sc, "memory") || !strings.Contains(sc, "cpu") {
			t.Errorf("%s/cgroup.subtree_control = %q", base, sc)
		}
	}
	limits := cgroup.Limits{MemoryBytes: MemoryLimit, CPUMilli: CPULimit}
	leaf, err := m.Prepare("vol-a", limits)
	if err != nil {
		t.Fatal(err)
	}
	if leaf.Path != filepath.Join(base, "daemons", "vol-a") || leaf.Enforced != enforced {
		t.Errorf("Prepare = %+v (enforced here: %t)", leaf, enforced)
	}
	// A daemon and its child (which leaves the daemon's session) start in
	// the leaf.
	d := spawn("daemon", leaf.Path, "/bin/sh", "-c", "setsid "+sleep+" 61 & exec "+sleep+" 60")
	if got := Of(fsRoot, d.PID); got != leaf.Path {
		t.Errorf("the daemon runs in %s, want %s", got, leaf.Path)
	}
	waitPopulatedChildren(t, leaf.Path, 2)
	if enforced {
		checkLimits(t, leaf.Path)
	}
	u, err := m.Usage("vol-a")
	if err != nil || u.HasMemory != enforced || (enforced && u.MemoryMax != MemoryLimit) {
		t.Errorf("Usage = %+v, %v", u, err)
	}
	// A restart's stop kills what is left in the leaf, a child that left
	// the daemon's session too, and the next daemon runs there.
	if err := m.KillProcs(context.Background(), "vol-a", 2*time.Second); err != nil {
		t.Error(err)
	}
	if d.Alive() || Populated(leaf.Path) {
		t.Errorf("KillProcs left processes in %s", leaf.Path)
	}
	next := spawn("next", leaf.Path, sleep, "60")
	time.Sleep(100 * time.Millisecond)
	if !next.Alive() || Of(fsRoot, next.PID) != leaf.Path {
		t.Errorf("the next daemon did not live in the leaf after KillProcs")
	}
	if enforced {
		oomKill(t, m, spawn)
	}
	for _, name := range []string{"vol-a", "vol-oom"} {
		if err := m.Remove(context.Background(), name, 2*time.Second); err != nil {
			t.Errorf("Remove(%s): %v", name, err)
		}
	}
	if next.Alive() {
		t.Errorf("daemon %s lives on after its cgroup was removed", next)
	}
	if names, err := m.Names(); err != nil || len(names) != 0 {
		t.Errorf("leaves left: %v, %v", names, err)
	}
	_ = daemon.Terminate(context.Background(), mounterProc, 0)
	return m.Mode()
}

func checkLimits(t *testing.T, leaf string) {
	t.Helper()
	if got := Read(t, leaf, "memory.max"); got != "33554432" {
		t.Errorf("memory.max = %q", got)
	}
	if got := Read(t, leaf, "cpu.max"); got != "25000 100000" {
		t.Errorf("cpu.max = %q", got)
	}
	if _, err := os.Stat(filepath.Join(leaf, "memory.swap.max")); err == nil {
		if got := Read(t, leaf, "memory.swap.max"); got != "0" {
			t.Errorf("memory.swap.max = %q", got)
		}
	}
}

// oomKill starts a "daemon" that reads 256 MiB into one buffer in a leaf
// of 32 MiB: the kernel kills it, and the leaf counts the kill.
func oomKill(t *testing.T, m *cgroup.Manager, spawn func(name, cg, path string, args ...string) daemon.Proc) {
	t.Helper()
	leaf, err := m.Prepare("vol-oom", cgroup.Limits{MemoryBytes: MemoryLimit})
	if err != nil {
		t.Fatal(err)
	}
	dd, err := exec.LookPath("dd")
	if err != nil {
		t.Fatal(err)
	}
	p := spawn("hog", leaf.Path, dd, "if=/dev/zero", "of=/dev/null", "bs=268435456", "count=1")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := daemon.Wait(ctx, p); err != nil {
		t.Fatalf("the allocating daemon still runs: %v", err)
	}
	u, err := m.Usage("vol-oom")
	if err != nil || u.OOMKills != leaf.OOMKills+1 {
		t.Errorf("after the hog: Usage = %+v, %v; want one OOM kill more than %d", u, err, leaf.OOMKills)
	}
}

// waitPopulatedChildren waits until n processes are in leaf.
func waitPopulatedChildren(t *testing.T, leaf string, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		procs := strings.Fields(Read(t, leaf, "cgroup.procs"))
		if len(procs) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s holds processes %v, want %d (the daemon and its child)", leaf, procs, n)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
