//go:build linux

package mounter_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/daemon/cgroup/cgrouptest"
	"github.com/mountplan/mountplan/internal/mounter"
)

// TestDaemonCgroup is TestDaemonLifecycle for a node with a cgroup for
// its daemons (a cgroup of the test's own): a leaf an earlier mounter
// left for a volume without a daemon is removed at start; each daemon
// starts in its volume's leaf, every generation in the same one, which
// teardown removes; usage is reported per volume and profile; a daemon
// killed by hand is no OOM kill. With the memory and cpu controllers
// (a unified host, test/vm's guest) the profile's limits are in the leaf
// and a daemon that allocates past them dies OOMKilled and is restarted
// in the same leaf; without (a hybrid host) usage says the limits are not
// enforced.
func TestDaemonCgroup(t *testing.T) {
	f := newDaemonFixture(t)
	ctx := context.Background()
	f.cgroup = cgrouptest.Dedicated(t, "mounter", "daemons")
	enforced := cgrouptest.HasControllers(f.cgroup)
	leafOf := func(id string) string { return filepath.Join(f.cgroup, "daemons", id) }
	if err := os.MkdirAll(leafOf("stale"), 0o755); err != nil {
		t.Fatal(err)
	}
	f.n = f.node()
	if _, err := os.Stat(leafOf("stale")); err == nil {
		t.Error("a mounter that starts left the empty leaf of a volume without a daemon")
	}

	const id = "vol"
	info := f.start(f.request(id, "squashfuse-limited"))
	if got := cgrouptest.Of(cgrouptest.FS(), info.PID); got != leafOf(id) || info.Command.Cgroup != leafOf(id) {
		t.Fatalf("daemon in cgroup %s (command says %q), want %s", got, info.Command.Cgroup, leafOf(id))
	}
	if enforced {
		if got := cgrouptest.Read(t, leafOf(id), "memory.max"); got != "67108864" {
			t.Errorf("memory.max = %q, want 64Mi", got)
		}
		if got := cgrouptest.Read(t, leafOf(id), "cpu.max"); got != "50000 100000" {
			t.Errorf("cpu.max = %q, want 500m", got)
		}
	}
	usage := f.usage(id)
	if usage.Profile != "squashfuse-limited" || usage.Cgroup != leafOf(id) || usage.LimitsEnforced != enforced ||
		usage.HasMemory != enforced || (enforced && (usage.MemoryBytes == 0 || usage.MemoryMaxBytes != 64<<20)) {
		t.Errorf("DaemonUsage = %+v (controllers here: %t)", usage, enforced)
	}

	// Killed by hand: no reason the mounter knows; the next generation
	// starts in the same leaf.
	if err := syscall.Kill(info.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, f.n, info.Proc)
	if st, err := f.n.DaemonStatus(ctx, info.Proc, 0); err != nil || st.Alive || st.Reason != "" {
		t.Errorf("DaemonStatus of a daemon killed by hand = %+v, %v", st, err)
	}
	f.stop(id, false)
	if _, err := os.Stat(leafOf(id)); err != nil {
		t.Errorf("a restart's stop removed the leaf: %v", err)
	}
	req := f.request(id, "squashfuse-limited")
	req.Generation = 2
	second := f.start(req)
	if got := cgrouptest.Of(cgrouptest.FS(), second.PID); got != leafOf(id) {
		t.Errorf("generation 2 in cgroup %s, want %s", got, leafOf(id))
	}
	if enforced {
		f.oomKilled(leafOf)
	} else {
		t.Logf("no memory and cpu controllers in %s: the OOM kill is proven in test/vm", f.cgroup)
	}
	f.stop(id, true)
	f.gone(id)
	if _, err := os.Stat(leafOf(id)); err == nil {
		t.Error("teardown left the volume's cgroup")
	}
}

// oomKilled starts hog, tells it to allocate past its 32Mi, and checks
// that the mounter says OOMKilled, that the next generation runs in the
// same leaf and that the leaf counts the kill.
func (f *daemonFixture) oomKilled(leafOf func(string) string) {
	t, ctx := f.t, context.Background()
	const id = "hog"
	info := f.start(f.request(id, "hog"))
	if err := os.WriteFile(filepath.Join(f.volDir(id), "work", "go"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitGone(t, f.n, info.Proc)
	st, err := f.n.DaemonStatus(ctx, info.Proc, 0)
	t.Logf("the mounter says of the hog: %s: %s", st.Reason, st.Detail)
	if err != nil || st.Alive || st.Reason != mounter.ReasonOOMKilled || !strings.Contains(st.Detail, "memory.max 33554432") {
		t.Fatalf("DaemonStatus of a daemon past its memory limit = %+v, %v", st, err)
	}
	// The supervisor's restart.
	if err := os.Remove(filepath.Join(f.volDir(id), "work", "go")); err != nil {
		t.Fatal(err)
	}
	f.stop(id, false)
	req := f.request(id, "hog")
	req.Generation = 2
	second := f.start(req)
	if got := cgrouptest.Of(cgrouptest.FS(), second.PID); got != leafOf(id) {
		t.Errorf("the restarted hog in cgroup %s, want %s", got, leafOf(id))
	}
	// The kernel counts each process it kills: the hog's shell, and at
	// times a second of its processes (squashfuse, a pipeline's) when
	// the leaf is still at its limit after the first.
	if u := f.usage(id); u.OOMKills < 1 || u.Profile != "hog" {
		t.Errorf("DaemonUsage after the OOM kill = %+v", u)
	}
	if st, err := f.n.DaemonStatus(ctx, second.Proc, 0); err != nil || !st.Alive || st.Reason != "" {
		t.Errorf("DaemonStatus of the restarted hog = %+v, %v", st, err)
	}
	f.stop(id, true)
	f.gone(id)
}

// usage is DaemonUsage's entry of volume id.
func (f *daemonFixture) usage(id string) mounter.DaemonUsage {
	f.t.Helper()
	all, err := f.n.DaemonUsage(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	for _, u := range all {
		if u.VolumeID == id {
			return u
		}
	}
	f.t.Fatalf("DaemonUsage has no entry of %s: %+v", id, all)
	return mounter.DaemonUsage{}
}

func waitGone(t *testing.T, n *mounter.Local, p daemon.Proc) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := n.WaitDaemon(ctx, p); err != nil {
		t.Fatalf("daemon %s still runs: %v", p, err)
	}
}

// TestDaemonWithoutCgroup: a node without a cgroup for its daemons (none
// asked for, or a directory that is no cgroup v2) runs them in its own
// cgroup as before and reports a profile's limits as not enforced.
func TestDaemonWithoutCgroup(t *testing.T) {
	f := newDaemonFixture(t)
	own := cgrouptest.Of(cgrouptest.FS(), os.Getpid())
	for _, base := range []string{"", f.dir} {
		f.cgroup = base
		f.n = f.node()
		info := f.start(f.request("vol", "squashfuse-limited"))
		if info.Command.Cgroup != "" || cgrouptest.Of(cgrouptest.FS(), info.PID) != own {
			t.Errorf("DaemonCgroup %q: the daemon runs in %s (command: %q), want the mounter's %s", base, cgrouptest.Of(cgrouptest.FS(), info.PID), info.Command.Cgroup, own)
		}
		if u := f.usage("vol"); u.LimitsEnforced || u.Cgroup != "" {
			t.Errorf("DaemonCgroup %q: DaemonUsage = %+v, want limits not enforced", base, u)
		}
		f.start(f.request("plain", "squashfuse"))
		if u := f.usage("plain"); !u.LimitsEnforced {
			t.Errorf("a profile without limits is reported as not enforced: %+v", u)
		}
		f.stop("vol", true)
		f.stop("plain", true)
		f.gone("vol")
	}
}

// TestDaemonCgroupNotAdopted: a restarted mounter that does not adopt a
// live daemon (its record says it never served) stops it through its cgroup: a process
// in the volume's leaf that left the daemon's session (started here with
// a session of its own, moved into the leaf) dies with it; the leaf stays
// for the volume's next daemon.
func TestDaemonCgroupNotAdopted(t *testing.T) {
	f := newDaemonFixture(t)
	f.cgroup = cgrouptest.Dedicated(t, "mounter", "daemons")
	f.n = f.node()
	const id = "vol"
	leaf := filepath.Join(f.cgroup, "daemons", id)
	info := f.start(f.request(id, "squashfuse-fd"))

	escapee := exec.Command("sleep", "60")
	escapee.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := escapee.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		_ = escapee.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = escapee.Process.Kill()
		<-exited
	})
	if err := os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(strconv.Itoa(escapee.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	// Not to be adopted while it runs on: its record says it never
	// served (what an earlier mounter that stopped while starting it
	// leaves). Unmounting would end the daemon too.
	recPath := filepath.Join(f.records, "daemons", id+".json")
	b, err := os.ReadFile(recPath)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	ds, _ := rec["daemons"].([]any)
	if len(ds) != 1 {
		t.Fatalf("record of %s: %s", id, b)
	}
	delete(ds[0].(map[string]any), "conn")
	if b, err = json.Marshal(rec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(recPath, b, 0o600); err != nil {
		t.Fatal(err)
	}

	f.n = f.node()
	if got := f.n.Adopted(); got != 0 {
		t.Errorf("the restarted mounter adopted %d daemons, want 0", got)
	}
	if info.Alive() {
		t.Errorf("daemon %s not adopted but still running", info.Proc)
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Errorf("a process in the leaf of a daemon not adopted (pid %d) still runs", escapee.Process.Pid)
	}
	if _, err := os.Stat(leaf); err != nil {
		t.Errorf("the leaf of a volume whose daemon was not adopted: %v", err)
	}
	f.stop(id, true)
	f.gone(id)
}

// TestDaemonCgroupRecordsDirMoved: the daemons' cgroups outside the
// mounter's (a cgroup v2 directory of the test's own stands for the
// host's), and a records dir whose device and inode changed without a
// reboot (copied back in place): the restarted mounter keeps the instance
// recorded in the adopted daemon's cgroup rather than the one it derives,
// so the adopted daemon's leaf is its volume's, and teardown removes it
// (Dedicated fails the test for any leaf left).
func TestDaemonCgroupRecordsDirMoved(t *testing.T) {
	f := newDaemonFixture(t)
	f.hostCgroup = cgrouptest.Dedicated(t)
	f.n = f.node()
	const id = "vol"
	info := f.start(f.request(id, "squashfuse-fd"))
	leaf := info.Command.Cgroup
	if !strings.HasPrefix(leaf, f.hostCgroup+"/mountplan-daemons/") {
		t.Fatalf("daemon's cgroup %q, want one below %s/mountplan-daemons", leaf, f.hostCgroup)
	}
	old := f.records + ".old"
	if err := os.Rename(f.records, old); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", old, f.records).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = os.RemoveAll(old) })

	f.n = f.node()
	if got := f.n.Adopted(); got != 1 {
		t.Fatalf("the restarted mounter adopted %d daemons, want 1", got)
	}
	if u := f.usage(id); u.Cgroup != leaf {
		t.Errorf("DaemonUsage's cgroup %q, want the adopted daemon's %q", u.Cgroup, leaf)
	}
	f.stop(id, true)
	f.gone(id)
	if _, err := os.Stat(leaf); err == nil {
		t.Errorf("teardown left the adopted daemon's leaf %s", leaf)
	}
}
