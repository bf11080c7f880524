package e2e

// FUSE volumes end to end (issue 4, "Proof"): for sshfs, rclone mount and
// squashfuse, the plugin stages the daemon, the sidecar mounts the volume
// into a real container, the container reads and writes; kill -9 of the
// daemon heals the container's mount in place within 5s while
// NodeGetVolumeHealth reports it abnormal; kill -9 of the plugin leaves the
// daemon and the container working, the restarted plugin adopts the same
// daemon, and Unstage leaves nothing behind.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/test/testutil"
)

// fuseCase is one profile under test.
type fuseCase struct {
	name    string
	command string // the daemon's binary, for the skip message
	// setup makes the backend and returns the volume's context and secrets,
	// and a function that reads a file of the backend directly ("" when
	// the backend is read-only).
	setup    func(t *testing.T, e *fuseEnv) (vctx, secrets map[string]string, backend func(name string) string)
	readOnly bool
	// viaServe makes the plugin use `mountplan-sidecar serve` as its
	// mounter, so that the heal's re-attach runs in the sidecar.
	viaServe bool
	// seeded is a file the backend holds from the start, with its content.
	seeded, seededContent string
}

func fuseCases() []fuseCase {
	return []fuseCase{
		{
			name: "sshfs", command: "sshfs", seeded: "seed.txt", seededContent: "over ssh\n",
			setup: func(t *testing.T, e *fuseEnv) (map[string]string, map[string]string, func(string) string) {
				s := startFuseSSHD(t)
				if err := os.WriteFile(filepath.Join(s.Data, "seed.txt"), []byte("over ssh\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				vctx := map[string]string{"type": "fuse", "profile": "sshfs", "source": "root@127.0.0.1:" + s.Data, "port": fmt.Sprint(s.Port)}
				secrets := map[string]string{"sshKey": s.UserKey, "knownHosts": s.KnownHosts + "\n"}
				return vctx, secrets, fuseReader(s.Data)
			},
		},
		{
			name: "rclone", command: "rclone", seeded: "seed.txt", seededContent: "local dir\n", viaServe: true,
			setup: func(t *testing.T, e *fuseEnv) (map[string]string, map[string]string, func(string) string) {
				dir := filepath.Join(e.rcloneRoot, "share")
				if err := os.Mkdir(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "seed.txt"), []byte("local dir\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return map[string]string{"type": "fuse", "profile": "rclone", "source": dir, "dirCacheTime": "1s"}, nil, fuseReader(dir)
			},
		},
		{
			name: "squashfuse", command: "squashfuse", readOnly: true, seeded: "hello.txt", seededContent: "from squashfs\n",
			setup: func(t *testing.T, e *fuseEnv) (map[string]string, map[string]string, func(string) string) {
				testutil.RequireCommands(t, "mksquashfs")
				src := filepath.Join(e.dir, "squash-src")
				if err := os.MkdirAll(filepath.Join(src, "sub"), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(src, "hello.txt"), []byte("from squashfs\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				img := filepath.Join(e.squashRoot, "image.sqfs")
				if out, err := exec.Command("mksquashfs", src, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
					t.Fatalf("mksquashfs: %v: %s", err, out)
				}
				return map[string]string{"type": "fuse", "profile": "squashfuse", "source": img}, nil, nil
			},
		},
	}
}

func fuseReader(dir string) func(string) string {
	return func(name string) string {
		b, _ := os.ReadFile(filepath.Join(dir, name))
		return string(b)
	}
}

func TestFuseLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter")
	testutil.RequireFile(t, "/dev/fuse", "the FUSE device")
	for _, c := range fuseCases() {
		t.Run(c.name, func(t *testing.T) {
			testutil.RequireCommands(t, c.command)
			testutil.NoLeaks(t)
			fuseLifecycle(t, c)
		})
	}
}

func fuseLifecycle(t *testing.T, c fuseCase) {
	start := time.Now()
	step := func(what string) { t.Logf("== %s (at %v)", what, time.Since(start).Round(time.Millisecond)) }
	ctrd := testutil.StartContainerd(t)
	ctr := ctrd.Run(t, "consumer", testutil.BusyboxRootfs(t), "sleep", "3600")
	var e *fuseEnv
	if c.viaServe {
		e = startFuseEnvServe(t)
	} else {
		e = startFuseEnv(t)
	}
	vctx, secrets, backend := c.setup(t, e)
	step("containerd, consumer container, plugin and backend running")

	id := "fuse-" + c.name
	if err := e.tryStage(id, mountCap("", rwo), vctx, secrets); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st := e.state(id)
	first := st.Daemon
	if !fuseAlive(first) || first.Conn == 0 || first.Generation != 1 {
		t.Fatalf("after stage the journal records daemon %+v; want a live generation 1 with a connection", first)
	}
	step(fmt.Sprintf("staged: daemon pid %d, FUSE connection %d", first.PID, first.Conn))
	var canary []string
	if c.name == "sshfs" {
		canary = fuseSecretLines(secrets["sshKey"])
		fuseCheckNoSecretInProcs(t, "after stage", canary)
	}

	const target = "/data"
	e.mustSidecarMount(id, ctr.PID(), target)
	in := func(script string) (string, error) { return testutil.Exec(t, ctr.PID(), "sh", "-c", script) }
	if out, err := in("cat " + target + "/" + c.seeded); err != nil || out != c.seededContent {
		t.Fatalf("reading %s inside the container: %q, %v", c.seeded, out, err)
	}
	fuseCheckBind(t, ctr.PID(), target, first.Conn)
	// readWrite proves the consumer works through the same path: a write
	// and a read back (a read of the seeded file for read-only backends).
	readWrite := func(tag string) error {
		if c.readOnly {
			out, err := in("cat " + target + "/" + c.seeded)
			if err != nil || out != c.seededContent {
				return fmt.Errorf("read %q, %v", out, err)
			}
			return nil
		}
		out, err := in(fmt.Sprintf("echo %s > %s/%s.txt && cat %s/%s.txt && cat %s/%s", tag, target, tag, target, tag, target, c.seeded))
		if err != nil || out != tag+"\n"+c.seededContent {
			return fmt.Errorf("write and read back %q, %v", out, err)
		}
		return nil
	}
	if err := readWrite("first"); err != nil {
		t.Fatalf("inside the container: %v", err)
	}
	if c.readOnly {
		if out, err := in("echo x > " + target + "/new.txt"); err == nil {
			t.Errorf("writing to the read-only %s volume succeeded: %q", c.name, out)
		}
	} else if !fuseBackendHolds(backend, "first.txt", "first\n") {
		t.Errorf("the backend holds %q for first.txt, want the container's write", backend("first.txt"))
	}
	if h, err := e.health(id); err != nil || h != "" {
		t.Errorf("health of a serving volume: %q, %v", h, err)
	}
	step("mounted in the container; read and written")

	// kill -9 of the daemon: the supervisor restarts it and re-attaches
	// the new mount inside the container, with no action from it.
	var sawAbnormal atomic.Value
	stopHealth := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stopHealth:
				return
			default:
			}
			if h, err := e.health(id); err == nil && h != "" && sawAbnormal.Load() == nil {
				sawAbnormal.Store(h)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	killed := time.Now()
	if err := syscall.Kill(first.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Asked at once, the plugin already knows: Health reads the process
	// table, not only the supervisor's last verdict.
	if h, err := e.health(id); err == nil && h != "" && sawAbnormal.Load() == nil {
		sawAbnormal.Store(h)
	}
	var healErr error
	healed := testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
		healErr = readWrite("healed")
		return healErr == nil
	})
	heal := time.Since(killed)
	if !healed {
		close(stopHealth)
		wg.Wait()
		t.Fatalf("the container did not read and write again within 5s of kill -9 of the daemon: %v", healErr)
	}
	t.Logf("heal time after kill -9 of the %s daemon: %v (kill to the first successful read and write inside the container)", c.name, heal.Round(time.Millisecond))
	// Health turns normal once the consumers are re-attached.
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool { h, err := e.health(id); return err == nil && h == "" }) {
		h, err := e.health(id)
		t.Errorf("health after the heal: %q, %v", h, err)
	}
	close(stopHealth)
	wg.Wait()
	if h := sawAbnormal.Load(); h == nil {
		t.Error("NodeGetVolumeHealth never reported the volume abnormal while its daemon was down")
	} else {
		t.Logf("health while down: %s", h)
	}
	second := e.daemon(id)
	fuseCheckBind(t, ctr.PID(), target, second.Conn)
	if second.PID == first.PID || second.Generation != 2 || !fuseAlive(second) {
		t.Errorf("after the heal the journal records %+v; want a new live daemon, generation 2", second)
	}
	if fuseAlive(first) {
		t.Errorf("the killed daemon %d still runs", first.PID)
	}
	if !c.readOnly && !fuseBackendHolds(backend, "healed.txt", "healed\n") {
		t.Errorf("the backend holds %q for healed.txt", backend("healed.txt"))
	}
	if c.name == "sshfs" {
		fuseCheckNoSecretInProcs(t, "after the restart", canary)
	}
	if e.mounter != nil {
		b := e.mounter.log()
		performed := false
		for _, line := range strings.Split(b, "\n") {
			performed = performed || strings.Contains(line, `"Mounted plan"`) && strings.Contains(line, fmt.Sprintf(`mountPoint="%s" pid=%d `, target, ctr.PID()))
		}
		if !performed {
			t.Errorf("mountplan-sidecar serve did not perform the re-attach in the container; its log:\n%s", b)
		}
		// The restarted daemon was started by the sidecar too (StartDaemon).
		if pp := fusePPid(second.PID); pp != e.mounter.pid() {
			t.Errorf("the restarted daemon's parent is pid %d, want the sidecar %d", pp, e.mounter.pid())
		}
	}
	step("daemon killed and healed")

	// kill -9 of the plugin: the daemon and the container do not notice.
	e.plugin.Kill9()
	if err := readWrite("pluginless"); err != nil {
		t.Errorf("with the plugin dead, inside the container: %v", err)
	}
	if !fuseAlive(second) {
		t.Fatalf("daemon %d died with the plugin", second.PID)
	}
	e.plugin.Restart()
	e.waitReady()
	// The startup reconcile adopts the same process and records it.
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool { return e.state(id).Daemon.PID == second.PID }) {
		t.Errorf("after the plugin's restart the journal records daemon %+v, want pid %d", e.state(id).Daemon, second.PID)
	}
	if !fuseAlive(second) {
		t.Errorf("daemon %d did not survive the plugin's restart", second.PID)
	}
	if d := e.daemon(id); d.PID != second.PID || d.Generation != 2 {
		t.Errorf("the restarted plugin started another daemon: %+v", d)
	}
	if ps := e.volumeDaemons(id, vctx); len(ps) != 1 {
		t.Errorf("want exactly one daemon for the volume after adoption, got %v", ps)
	}
	if err := readWrite("adopted"); err != nil {
		t.Errorf("after the plugin's restart, inside the container: %v", err)
	}
	if h, err := e.health(id); err != nil || h != "" {
		t.Errorf("health after adoption: %q, %v", h, err)
	}
	step(fmt.Sprintf("plugin killed and restarted; daemon pid %d adopted", second.PID))

	e.mustSidecarUnmount(id, ctr.PID(), target)
	e.unstage(id)
	if fuseAlive(second) {
		t.Errorf("daemon %d still runs after unstage", second.PID)
	}
	e.checkClean(id)
	if _, err := e.record(id); err == nil {
		t.Errorf("the static volume's record outlived its unstage")
	}
	if c.name == "sshfs" {
		log := e.plugin.Log()
		for _, p := range canary {
			if strings.Contains(log, p) {
				t.Errorf("the plugin's log (--v=5) holds a piece of the secret")
				break
			}
		}
		if !strings.Contains(log, "NodeStageVolume") {
			t.Errorf("the plugin's log shows no NodeStageVolume request: is --v=5 in effect?")
		}
	}
	step("unstaged; nothing left")
}

// fuseCheckBind checks that pid's namespace has, on top at mountPoint,
// exactly one FUSE mount, of connection conn, mounted nosuid,nodev: a
// healed consumer holds the new daemon's mount, not the dead one under it.
func fuseCheckBind(t *testing.T, pid int, mountPoint string, conn uint64) {
	t.Helper()
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	var at []string
	for _, mi := range infos {
		if mi.Mountpoint != mountPoint {
			continue
		}
		at = append(at, fmt.Sprintf("%s %d:%d %s", mi.FSType, mi.Major, mi.Minor, mi.Options))
		if !strings.HasPrefix(mi.FSType, "fuse") || uint64(mi.Major)<<20|uint64(mi.Minor) != conn {
			t.Errorf("in pid %d's namespace %s holds %s %d:%d, want FUSE connection %d", pid, mountPoint, mi.FSType, mi.Major, mi.Minor, conn)
		}
		for _, o := range []string{"nosuid", "nodev"} {
			if !strings.Contains(","+mi.Options+",", ","+o+",") {
				t.Errorf("in pid %d's namespace %s lacks %s: %s", pid, mountPoint, o, mi.Options)
			}
		}
	}
	if len(at) != 1 {
		t.Errorf("in pid %d's namespace %s holds %d mounts, want 1: %v", pid, mountPoint, len(at), at)
	}
}

// fuseBackendHolds waits a little for a write made through the mount to
// reach the backend: sshfs sends writes to the server asynchronously.
func fuseBackendHolds(backend func(string) string, name, want string) bool {
	return testutil.Poll(2*time.Second, 10*time.Millisecond, func() bool { return backend(name) == want })
}
