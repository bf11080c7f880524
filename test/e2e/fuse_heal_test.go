package e2e

// A FUSE daemon's restart heals every container that uses the volume,
// however it got the mount (issue 9, item 2): a container to which the
// runtime bound kubelet's publish target (as containerd does for a pod)
// holds a copy of the mount of its own, which no propagation replaces, and
// so does a container that got the volume through NodePrepare. After kill
// -9 of the daemon, and after the container that runs the daemons is
// killed and restarted (the mounter's, or the plugin's when it runs them),
// both read and write again with no action of theirs, and the time from
// the kill to the first successful read and write in each is measured.
// NodeGetVolumeHealth stays abnormal while any copy of a dead connection is
// left: a copy the mounter may not replace (in the host's namespace outside
// kubelet's directory) keeps it abnormal until it is gone.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

func TestFuseHealEveryCopy(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter", "rclone")
	testutil.RequireFile(t, "/dev/fuse", "the FUSE device")
	t.Run("daemons in the plugin", func(t *testing.T) { fuseHealEveryCopy(t, false) })
	t.Run("daemons in the mounter", func(t *testing.T) { fuseHealEveryCopy(t, true) })
}

// healConsumer is a container using the volume at /data.
type healConsumer struct {
	name string
	pid  int
}

func fuseHealEveryCopy(t *testing.T, viaMounter bool) {
	testutil.NoLeaks(t)
	plugCg, sideCg := fuseCgroups(t)
	ctrd := testutil.StartContainerd(t)
	e := newFuseEnv(t, "")
	if viaMounter {
		e.startMounter(sideCg)
	}
	e.startPlugin(plugCg, "--v=4")
	share := filepath.Join(e.rcloneRoot, "share")
	if err := os.Mkdir(share, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(share, "seed.txt"), []byte("local dir\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const id = "fuse-heal"
	if err := e.tryStage(id, mountCap("", rwo), map[string]string{"type": "fuse", "profile": "rclone", "source": share, "dirCacheTime": "1s"}, nil); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	target := e.target(id, "mount")
	e.publish(id, target, mountCap("", rwo), false, nil)
	published := ctrd.RunWithBinds(t, "published", testutil.BusyboxRootfs(t), map[string]string{"/data": target}, "sleep", "3600")
	prepared := ctrd.Run(t, "prepared", testutil.BusyboxRootfs(t), "sleep", "3600")
	e.mustSidecarMount(id, prepared.PID(), "/data")
	consumers := []healConsumer{{"the published container (runtime bind of kubelet's target)", published.PID()},
		{"the prepared container (NodePrepare)", prepared.PID()}}
	for _, c := range consumers {
		if err := fuseHealReadWrite(t, c, "start"); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}

	// A copy the mounter may not replace: the volume stays abnormal while
	// it is there.
	stray := fuseStrayCopy(t, filepath.Join(e.volDir(id), "mnt"))
	first := e.daemon(id)
	e.healAfter(t, id, "kill -9 of the daemon", consumers, true, func() {
		if err := syscall.Kill(first.PID, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool { h, _ := e.health(id); return strings.HasPrefix(h, "StaleMounts") }) {
		h, err := e.health(id)
		t.Errorf("health with a copy of the dead connection left at %s: %q, %v; want StaleMounts", stray, h, err)
	}
	if err := unix.Unmount(stray, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if !testutil.Poll(40*time.Second, 50*time.Millisecond, func() bool { h, err := e.health(id); return err == nil && h == "" }) {
		h, err := e.health(id)
		t.Errorf("health once the last copy is gone: %q, %v", h, err)
	}
	second := e.daemon(id)
	if second.Generation != 2 || len(e.state(id).Stale) != 0 {
		t.Errorf("after the heal the journal records daemon %+v, stale connections %v", second, e.state(id).Stale)
	}
	fuseHealCheckCopies(t, consumers, target, second.Conn)

	// The container that runs the daemons is killed and restarted.
	what := "kill of the plugin's container (it runs the daemons), and its restart"
	if viaMounter {
		what = "kill of the mounter's container (it runs the daemons), and its restart"
	}
	// A restarted plugin heals before it answers: only a mounter's
	// restart leaves the plugin there to say the volume is abnormal.
	e.healAfter(t, id, what, consumers, viaMounter, func() {
		if viaMounter {
			fuseKillCgroup(t, sideCg)
			e.startMounter(sideCg)
			return
		}
		fuseKillCgroup(t, plugCg)
		if !e.plugin.Exited(10 * time.Second) {
			t.Fatal("the plugin still runs 10s after its cgroup was emptied")
		}
		e.plugin.Restart()
		e.waitReady()
	})
	if !testutil.Poll(30*time.Second, 50*time.Millisecond, func() bool { h, err := e.health(id); return err == nil && h == "" }) {
		h, err := e.health(id)
		t.Errorf("health after the heal: %q, %v", h, err)
	}
	third := e.daemon(id)
	if third.Generation != 3 || fuseAlive(second) {
		t.Errorf("after the second heal the journal records %+v; the second daemon alive: %t", third, fuseAlive(second))
	}
	fuseHealCheckCopies(t, consumers, target, third.Conn)
	for _, c := range consumers {
		for _, tag := range []string{"start", "healed"} {
			name := fuseHealFile(c, tag)
			if !fuseBackendHolds(fuseReader(share), name, tag+"\n") {
				t.Errorf("the backend holds %q for %s, written by %s", fuseReader(share)(name), name, c.name)
			}
		}
	}

	e.mustSidecarUnmount(id, prepared.PID(), "/data")
	prepared.Kill(t)
	published.Kill(t)
	e.unpublish(id, target)
	e.unstage(id)
	e.checkClean(id)
}

// healAfter runs event (a kill), then polls every consumer in parallel
// until a write and a read back succeed inside it, and logs the time from
// the kill to that first success: the heal time. With wantAbnormal the
// volume must be seen abnormal meanwhile.
func (e *fuseEnv) healAfter(t *testing.T, id, event string, consumers []healConsumer, wantAbnormal bool, kill func()) {
	t.Helper()
	abnormal := make(chan string, 1)
	stop := make(chan struct{})
	var watch sync.WaitGroup
	watch.Add(1)
	go func() {
		defer watch.Done()
		for {
			if h, err := e.health(id); err == nil && h != "" {
				abnormal <- h
				return
			}
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	start := time.Now()
	kill()
	took := make([]time.Duration, len(consumers))
	errs := make([]error, len(consumers))
	var wg sync.WaitGroup
	for i, c := range consumers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(start) < time.Minute {
				if errs[i] = fuseHealReadWrite(t, c, "healed"); errs[i] == nil {
					took[i] = time.Since(start)
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	close(stop)
	watch.Wait()
	for i, c := range consumers {
		if errs[i] != nil {
			t.Errorf("after %s, %s did not read and write again within a minute: %v", event, c.name, errs[i])
			continue
		}
		t.Logf("heal time after %s: %s reads and writes again %v after the kill", event, c.name, took[i].Round(time.Millisecond))
	}
	select {
	case h := <-abnormal:
		t.Logf("health while it healed: %s", h)
	default:
		if wantAbnormal {
			t.Errorf("NodeGetVolumeHealth never reported the volume abnormal after %s", event)
		}
	}
}

func fuseHealFile(c healConsumer, tag string) string {
	return fmt.Sprintf("%d-%s.txt", c.pid, tag)
}

// fuseHealReadWrite writes a file through the container's /data, reads it
// back and reads the backend's seed file, in one shell inside it.
func fuseHealReadWrite(t *testing.T, c healConsumer, tag string) error {
	f := "/data/" + fuseHealFile(c, tag)
	out, err := testutil.Exec(t, c.pid, "sh", "-c", fmt.Sprintf("echo %s > %s && cat %s && cat /data/seed.txt", tag, f, f))
	if err != nil || out != tag+"\nlocal dir\n" {
		return fmt.Errorf("write and read back %q, %v", out, err)
	}
	return nil
}

// fuseHealCheckCopies checks that each container, and kubelet's target,
// hold exactly one mount, of connection conn.
func fuseHealCheckCopies(t *testing.T, consumers []healConsumer, target string, conn uint64) {
	t.Helper()
	for _, c := range consumers {
		fuseCheckBind(t, c.pid, "/data", conn)
	}
	fuseCheckBind(t, os.Getpid(), target, conn)
}

// fuseStrayCopy binds src at a directory outside the kubelet dir (the
// harness gives the plugin and the mounter $TMPDIR), in the host's
// namespace: a copy no heal may replace. A cleanup removes it.
func fuseStrayCopy(t *testing.T, src string) string {
	t.Helper()
	dir, err := os.MkdirTemp("/run", "mountplan-e2e-stray-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		_ = os.Remove(dir)
	})
	if err := unix.Mount(src, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	return dir
}
