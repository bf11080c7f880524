package e2e

// FUSE daemons outlive the mounter (issue 34): started with
// --host-cgroupfs, each daemon runs in cgroups of its own below the host's
// hierarchies' roots, outside the mounter's; a mounter killed with SIGKILL
// leaves it serving, and the next mounter on the same records adopts it
// (same PID and start time). A daemon that died while no mounter ran is
// replaced once one runs again.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/test/testutil"
)

const hostCgroupFS = "/sys/fs/cgroup"

func TestFuseDaemonsOutliveMounter(t *testing.T) {
	fuseRequireFuse(t)
	testutil.NoLeaks(t)
	e := newFuseEnv(t, "")
	m := e.startMounter("", "--host-cgroupfs="+hostCgroupFS)
	e.startPlugin("", "--v=5")
	id := "fuse-outlive"
	if err := e.tryStage(id, mountCap("", rwo), fuseSquashVolume(t, e, "outlive"), nil); err != nil {
		t.Fatal(err)
	}
	// Read through kubelet's target, as a pod's container would.
	target := e.target(id, "mount")
	e.publish(id, target, mountCap("", rwo), true, nil)
	file := filepath.Join(target, "hello.txt")
	read := func() error {
		b, err := os.ReadFile(file)
		if err == nil && string(b) != "from squashfs\n" {
			err = fmt.Errorf("read %q", b)
		}
		return err
	}
	if err := read(); err != nil {
		t.Fatal(err)
	}
	d := e.daemon(id)
	// Its cgroups: none of the mounter's (in each hierarchy where the
	// mounter is below the root, the daemon is elsewhere, below
	// mountplan-daemons/).
	own := cgroupsOf(t, m.pid())
	mine := cgroupsOf(t, d.PID)
	var outside int
	for h, p := range own {
		if p == "/" {
			continue
		}
		if mine[h] == p || strings.HasPrefix(mine[h], p+"/") {
			t.Errorf("daemon %d is in the mounter's cgroup %s:%s", d.PID, h, mine[h])
		}
		if !strings.Contains(mine[h], "/mountplan-daemons/") {
			t.Errorf("daemon %d: cgroup %s:%s is not below mountplan-daemons/", d.PID, h, mine[h])
		}
		outside++
	}
	t.Logf("daemon %d's cgroups: %v (the mounter's: %v)", d.PID, mine, own)

	// The mounter killed: the daemon serves on, with no mounter at all.
	m.kill9()
	stop := make(chan struct{})
	failed := make(chan error, 1)
	reads := 0
	go func() {
		defer close(failed)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := read(); err != nil {
				failed <- err
				return
			}
			reads++
			time.Sleep(5 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond)
	if !fuseAlive(d) {
		t.Fatalf("daemon %v died with the mounter", d.PID)
	}
	m = e.startMounter("", "--host-cgroupfs="+hostCgroupFS)
	want := fmt.Sprintf("adopted FUSE daemon pid %d of volume %s", d.PID, id)
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool { return strings.Contains(m.log(), want) }) {
		t.Errorf("the new mounter's log does not say %q", want)
	}
	time.Sleep(2 * time.Second) // the plugin's supervisor watches it through the new mounter
	close(stop)
	if err := <-failed; err != nil {
		t.Errorf("a read through the mount failed across the mounter's restart: %v", err)
	}
	t.Logf("%d reads through the mount across the mounter's kill and restart, none failed", reads)
	if now := e.daemon(id); now.PID != d.PID || now.Generation != d.Generation || !fuseAlive(now) {
		t.Errorf("the daemon after the mounter's restart is %+v, was %+v", now, d)
	}

	// A daemon killed while no mounter runs: the next mounter does not
	// adopt it, and the plugin's heal replaces it through that mounter.
	m.kill9()
	if err := syscall.Kill(d.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool { return !fuseAlive(d) }) {
		t.Fatal("the killed daemon did not exit")
	}
	m = e.startMounter("", "--host-cgroupfs="+hostCgroupFS)
	if !testutil.Poll(20*time.Second, 50*time.Millisecond, func() bool {
		now := e.daemon(id)
		return now.PID != d.PID && fuseAlive(now) && read() == nil
	}) {
		t.Fatalf("the dead daemon was not replaced: %+v, read: %v", e.daemon(id), read())
	}
	if log := m.log(); !strings.Contains(log, fmt.Sprintf("FUSE daemon pid %d of volume %s is gone", d.PID, id)) {
		t.Errorf("the mounter's log does not say the daemon was gone")
	}
	healed := e.daemon(id)
	if mine := cgroupsOf(t, healed.PID); outside > 0 && !strings.Contains(strings.Join(mapValues(mine), " "), "/mountplan-daemons/") {
		t.Errorf("the replacement daemon %d is not in its own cgroups: %v", healed.PID, mine)
	}
	leaves := daemonLeaves(t, id)
	if outside > 0 && len(leaves) == 0 {
		t.Errorf("no cgroup of volume %s below mountplan-daemons/", id)
	}
	e.unpublish(id, target)
	e.unstage(id)
	e.checkClean(id)
	if left := daemonLeaves(t, id); len(left) > 0 {
		t.Errorf("the volume's cgroups are left after unstage: %v", left)
	}
	// And the mounter's levels above them, with no daemon left (the
	// memory hierarchy: the mounter always has a leaf there).
	if p := mine["memory"]; strings.Contains(p, "/mountplan-daemons/") {
		inst := filepath.Join(hostCgroupFS, "memory", filepath.Dir(p))
		if _, err := os.Stat(inst); err == nil {
			t.Errorf("%s is left after the last volume's unstage", inst)
		}
	}
}

// cgroupsOf maps each hierarchy of /proc/PID/cgroup ("memory", "0" for
// the unified one) to the process's path in it.
func cgroupsOf(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 {
			h := f[1]
			if h == "" {
				h = f[0]
			}
			out[h] = f[2]
		}
	}
	return out
}

func mapValues(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// daemonLeaves lists the cgroup directories of volume id below any
// hierarchy's mountplan-daemons/<instance>/ (v2: .../daemons/).
func daemonLeaves(t *testing.T, id string) []string {
	t.Helper()
	var out []string
	for _, pat := range []string{"*/mountplan-daemons/*/" + id, "*/mountplan-daemons/*/daemons/" + id, "mountplan-daemons/*/daemons/" + id} {
		m, err := filepath.Glob(filepath.Join(hostCgroupFS, pat))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m...)
	}
	return out
}
