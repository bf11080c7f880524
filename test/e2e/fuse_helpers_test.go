package e2e

// Helpers of the TestFuse* tests (FUSE volumes, issue 4): the real plugin
// with the example profiles of pkg/source/fuse/testdata, the real daemons
// from Debian's packages (sshfs against an sshd started here, rclone,
// squashfuse), consumers in real containers, and views of the kernel that
// do not go through the product. Every name starts with "fuse".

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/endpoint"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/source/fuse"
	"github.com/mountplan/mountplan/test/testutil"
)

const fuseRPCTimeout = 60 * time.Second

// fuseEnv is one plugin started with the example profiles, its clients,
// and the sidecar binary.
type fuseEnv struct {
	t       *testing.T
	plugin  *testutil.Plugin
	sidecar string
	node    csi.NodeClient
	ids     csi.IdentityClient
	np      api.NodePrepareClient
	dir     string // staging paths, config
	config  string // the admin config, for the plugin and the sidecar
	// roots replace the example config's /srv/rclone and /srv/squashfs.
	rcloneRoot, squashRoot string
	// serveLog is the log of the `mountplan-sidecar serve` the plugin
	// uses as its mounter ("" when it performs plans in process), servePID
	// its process.
	serveLog string
	servePID int
}

// fuseProfilesPath is the example config that README documents.
func fuseProfilesPath(t *testing.T) string {
	root, err := testutil.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "pkg", "source", "fuse", "testdata", "profiles.yaml")
}

// startFuseEnv builds the binaries, writes the example config with the
// roots pointed at test directories, and starts the plugin with --v=5 and
// args.
func startFuseEnv(t *testing.T, args ...string) *fuseEnv {
	t.Helper()
	return startFuseEnvWith(t, "", args...)
}

// startFuseEnvWith is startFuseEnv with more profiles (YAML list items)
// appended to the example config.
func startFuseEnvWith(t *testing.T, moreProfiles string, args ...string) *fuseEnv {
	t.Helper()
	e := newFuseEnv(t, moreProfiles)
	e.startPlugin("", args...)
	return e
}

// newFuseEnv builds the binaries and writes the example config (with more
// profiles appended) with the roots pointed at test directories; it starts
// nothing.
func newFuseEnv(t *testing.T, moreProfiles string) *fuseEnv {
	t.Helper()
	_, sidecarBin := testutil.BuildBinaries(t)
	e := &fuseEnv{t: t, sidecar: sidecarBin, dir: t.TempDir()}
	e.rcloneRoot = filepath.Join(e.dir, "rclone-root")
	e.squashRoot = filepath.Join(e.dir, "squash-root")
	for _, d := range []string{e.rcloneRoot, e.squashRoot} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(fuseProfilesPath(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg := strings.NewReplacer("/srv/rclone", e.rcloneRoot, "/srv/squashfs", e.squashRoot).Replace(string(b)) + moreProfiles
	e.config = filepath.Join(e.dir, "config.yaml")
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return e
}

// startPlugin starts the plugin with the config, --v=5 and args, in
// cgroup ("" for the test's own), connects its clients and waits until it
// is ready.
func (e *fuseEnv) startPlugin(cgroup string, args ...string) {
	t := e.t
	t.Helper()
	pluginBin, _ := testutil.BuildBinaries(t)
	e.plugin = testutil.StartPluginInCgroup(t, pluginBin, cgroup, append([]string{"--config", e.config, "--v=5"}, args...)...)
	conn, err := endpoint.Dial(e.plugin.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.node = csi.NewNodeClient(conn)
	e.ids = csi.NewIdentityClient(conn)
	e.np = api.NewNodePrepareClient(conn)
	e.waitReady()
}

func (e *fuseEnv) waitReady() {
	e.t.Helper()
	ok := testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		resp, err := e.ids.Probe(ctx, &csi.ProbeRequest{})
		return err == nil && resp.GetReady().GetValue()
	})
	if !ok {
		e.t.Fatal("plugin not ready within 30s")
	}
}

func (e *fuseEnv) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), fuseRPCTimeout)
	e.t.Cleanup(cancel)
	return ctx
}

func fuseMountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
}

func (e *fuseEnv) staging(id string) string { return filepath.Join(e.dir, "staging", id) }

func (e *fuseEnv) tryStage(id string, vctx, secrets map[string]string) error {
	_, err := e.node.NodeStageVolume(e.ctx(), &csi.NodeStageVolumeRequest{VolumeId: id,
		StagingTargetPath: e.staging(id), VolumeCapability: fuseMountCap(), VolumeContext: vctx, Secrets: secrets})
	return err
}

func (e *fuseEnv) unstage(id string) {
	e.t.Helper()
	if _, err := e.node.NodeUnstageVolume(e.ctx(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging(id)}); err != nil {
		e.t.Fatalf("NodeUnstageVolume %s: %v", id, err)
	}
}

// health returns the abnormal reason of a volume ("" when healthy).
func (e *fuseEnv) health(id string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		return "", err
	}
	for _, h := range resp.GetVolumeHealth().GetHealthStatuses() {
		return h.GetReason() + ": " + h.GetMessage(), nil
	}
	return "", nil
}

// sidecarMount runs `mountplan-sidecar mount` as hack/demo.sh does.
func (e *fuseEnv) sidecarMount(id string, pid int, target string) {
	e.t.Helper()
	e.runSidecar("mount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--staging-path", e.staging(id), "--pid", strconv.Itoa(pid), "--target", target,
		"--allowed-root", e.plugin.StateDir)
}

func (e *fuseEnv) sidecarUnmount(id string, pid int, target string) {
	e.t.Helper()
	e.runSidecar("unmount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", id,
		"--pid", strconv.Itoa(pid), "--target", target)
}

func (e *fuseEnv) runSidecar(args ...string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), fuseRPCTimeout)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, e.sidecar, args...).CombinedOutput()
	e.t.Logf("mountplan-sidecar %s (%v): %s", args[0], time.Since(start).Round(time.Millisecond), strings.TrimSpace(string(out)))
	if err != nil {
		e.t.Fatalf("mountplan-sidecar %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// record reads the journal's record of id straight from its file.
func (e *fuseEnv) record(id string) (*journal.Volume, error) {
	b, err := os.ReadFile(filepath.Join(e.plugin.StateDir, "volumes", id+".json"))
	if err != nil {
		return nil, err
	}
	v := &journal.Volume{}
	return v, json.Unmarshal(b, v)
}

// state returns the fuse state the journal holds for id.
func (e *fuseEnv) state(id string) fuse.State {
	e.t.Helper()
	v, err := e.record(id)
	if err != nil {
		e.t.Fatalf("record of %s: %v", id, err)
	}
	if v.Stage == nil || len(v.Stage.Source) == 0 {
		e.t.Fatalf("record of %s has no stage state: %+v", id, v)
	}
	var st fuse.State
	if err := json.Unmarshal(v.Stage.Source, &st); err != nil {
		e.t.Fatal(err)
	}
	return st
}

// volDir is the volume's directory under the state dir.
func (e *fuseEnv) volDir(id string) string { return filepath.Join(e.plugin.StateDir, "fuse", id) }

// daemon reads daemon.json: the supervisor's latest incarnation.
func (e *fuseEnv) daemon(id string) fuse.Daemon {
	e.t.Helper()
	var d fuse.Daemon
	b, err := os.ReadFile(filepath.Join(e.volDir(id), "daemon.json"))
	if err != nil {
		e.t.Fatalf("daemon record of %s: %v", id, err)
	}
	if err := json.Unmarshal(b, &d); err != nil {
		e.t.Fatal(err)
	}
	return d
}

// checkClean proves that nothing of volume id is left: no directory, no
// mount and no process naming it.
func (e *fuseEnv) checkClean(id string) {
	e.t.Helper()
	dir := e.volDir(id)
	if _, err := os.Lstat(dir); err == nil {
		ents, _ := os.ReadDir(dir)
		e.t.Errorf("%s still exists after unstage (entries %v)", dir, ents)
	}
	ms, _ := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	for _, m := range ms {
		e.t.Errorf("mount left under the state dir: %s (%s)", m.Mountpoint, m.FSType)
	}
	if ps := fuseProcsMentioning(dir); len(ps) > 0 {
		e.t.Errorf("processes left that name %s: %v", dir, ps)
	}
}

// fuseProcsMentioning returns the live processes whose command line
// contains s.
func fuseProcsMentioning(s string) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile("/proc/" + ent.Name() + "/cmdline")
		if err != nil || len(b) == 0 {
			continue
		}
		stat, _ := os.ReadFile("/proc/" + ent.Name() + "/stat")
		if i := strings.LastIndexByte(string(stat), ')'); i > 0 && strings.HasPrefix(string(stat[i+1:]), " Z") {
			continue
		}
		cmd := strings.ReplaceAll(string(b), "\x00", " ")
		if strings.Contains(cmd, s) {
			out[pid] = cmd
		}
	}
	return out
}

// fuseAlive reports whether d's process still runs (same start time).
func fuseAlive(d fuse.Daemon) bool { return d.Alive() }

// fuseFreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func fuseFreePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// fuseSSHD is an sshd on 127.0.0.1 with a temporary host key, accepting a
// temporary user key for root, serving SFTP from its internal server.
type fuseSSHD struct {
	Port       int
	Dir        string // keys and config
	Data       string // the exported directory
	UserKey    string // private key (the secret)
	KnownHosts string // "[127.0.0.1]:PORT ssh-ed25519 ..."
	cmd        *exec.Cmd
	done       chan struct{}
}

func startFuseSSHD(t *testing.T) *fuseSSHD {
	t.Helper()
	testutil.RequireCommands(t, "ssh-keygen")
	sshd := "/usr/sbin/sshd"
	testutil.RequireFile(t, sshd, "sshd (Debian package openssh-server)")
	dir, err := os.MkdirTemp("", "mpsshd-")
	if err != nil {
		t.Fatal(err)
	}
	testutil.RegisterLeakMarker(dir)
	s := &fuseSSHD{Dir: dir, Data: filepath.Join(dir, "data"), done: make(chan struct{})}
	t.Cleanup(func() {
		s.stop()
		os.RemoveAll(dir)
	})
	if err := os.Mkdir(s.Data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"host_key", "user_key"} {
		if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mountplan-test", "-f", filepath.Join(dir, k)).CombinedOutput(); err != nil {
			t.Fatalf("ssh-keygen: %v: %s", err, out)
		}
	}
	pub, err := os.ReadFile(filepath.Join(dir, "user_key.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "authorized_keys"), pub, 0o600); err != nil {
		t.Fatal(err)
	}
	key, err := os.ReadFile(filepath.Join(dir, "user_key"))
	if err != nil {
		t.Fatal(err)
	}
	s.UserKey = string(key)
	// The private key lives in the secret only: no copy on disk.
	_ = os.Remove(filepath.Join(dir, "user_key"))
	hostPub, err := os.ReadFile(filepath.Join(dir, "host_key.pub"))
	if err != nil {
		t.Fatal(err)
	}
	// sshd needs its privilege separation directory.
	if _, err := os.Stat("/run/sshd"); os.IsNotExist(err) {
		if err := os.Mkdir("/run/sshd", 0o755); err == nil {
			t.Cleanup(func() { os.Remove("/run/sshd") })
		}
	}
	for attempt := 0; ; attempt++ {
		s.Port = fuseFreePort(t)
		s.KnownHosts = fmt.Sprintf("[127.0.0.1]:%d %s", s.Port, strings.TrimSpace(string(hostPub)))
		cfg := fmt.Sprintf(`Port %d
ListenAddress 127.0.0.1
HostKey %s
AuthorizedKeysFile %s
PidFile none
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
Subsystem sftp internal-sftp
LogLevel ERROR
`, s.Port, filepath.Join(dir, "host_key"), filepath.Join(dir, "authorized_keys"))
		cfgPath := filepath.Join(dir, "sshd_config")
		if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		s.cmd = exec.Command(sshd, "-D", "-e", "-f", cfgPath)
		s.cmd.Stderr, _ = os.Create(filepath.Join(dir, "sshd.log"))
		s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := s.cmd.Start(); err != nil {
			t.Fatalf("starting sshd: %v", err)
		}
		s.done = make(chan struct{})
		go func(c *exec.Cmd, done chan struct{}) { _ = c.Wait(); close(done) }(s.cmd, s.done)
		up := testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
			select {
			case <-s.done:
				return true
			default:
			}
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", s.Port), time.Second)
			if err != nil {
				return false
			}
			c.Close()
			return true
		})
		select {
		case <-s.done:
			log, _ := os.ReadFile(filepath.Join(dir, "sshd.log"))
			if attempt < 3 {
				continue // the port was taken meanwhile
			}
			t.Fatalf("sshd exited: %s", log)
		default:
		}
		if !up {
			t.Fatal("sshd did not listen within 5s")
		}
		return s
	}
}

var fuseStopMu sync.Mutex

// stop kills sshd (and its per-connection children, in its session only
// when they are its descendants: they exit when their client goes).
func (s *fuseSSHD) stop() {
	fuseStopMu.Lock()
	defer fuseStopMu.Unlock()
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}

// fuseSecretLines are the pieces of a secret that must appear nowhere: the
// whole value and every line long enough to be recognised.
func fuseSecretLines(secret string) []string {
	out := []string{strings.TrimSpace(secret)}
	for _, l := range strings.Split(secret, "\n") {
		if l = strings.TrimSpace(l); len(l) >= 16 && !strings.HasPrefix(l, "-----") {
			out = append(out, l)
		}
	}
	return out
}

// fuseCheckNoSecretInProcs fails t if a piece of secret appears in any
// process's command line or environment.
func fuseCheckNoSecretInProcs(t *testing.T, when string, pieces []string) {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	checked := 0
	for _, ent := range ents {
		if _, err := strconv.Atoi(ent.Name()); err != nil {
			continue
		}
		for _, f := range []string{"cmdline", "environ"} {
			b, err := os.ReadFile("/proc/" + ent.Name() + "/" + f)
			if err != nil {
				continue
			}
			checked++
			for _, p := range pieces {
				if strings.Contains(string(b), p) {
					t.Errorf("%s: /proc/%s/%s holds a piece of the secret", when, ent.Name(), f)
				}
			}
		}
	}
	if checked == 0 {
		t.Errorf("%s: could not read any /proc/*/cmdline or environ", when)
	}
}

// startFuseEnvServe starts `mountplan-sidecar serve` and the plugin with it
// as its mounter (--mounter-endpoint): kubelet's publishes, the re-attach
// of healed consumers and the FUSE daemons go through the sidecar's
// process.
func startFuseEnvServe(t *testing.T, args ...string) *fuseEnv {
	t.Helper()
	e := newFuseEnv(t, "")
	state, sock := e.startServe("")
	e.startPlugin("", append([]string{"--state-dir", state, "--mounter-endpoint", "unix://" + sock}, args...)...)
	return e
}

// startServe starts `mountplan-sidecar serve --config` with the env's
// config and a fresh state dir as its allowed root, in cgroup ("" for the
// test's own); it returns the state dir and the socket. A cleanup stops
// it; its log is e.serveLog.
func (e *fuseEnv) startServe(cgroup string) (state, sock string) {
	t := e.t
	t.Helper()
	dir, err := os.MkdirTemp("", "mpfsrv-")
	if err != nil {
		t.Fatal(err)
	}
	testutil.RegisterLeakMarker(dir)
	t.Cleanup(func() { os.RemoveAll(dir) })
	state, sock = filepath.Join(dir, "state"), filepath.Join(dir, "mounter.sock")
	e.serveLog = filepath.Join(dir, "serve.log")
	cmd := exec.Command(e.sidecar, "serve", "--endpoint", "unix://"+sock, "--allowed-root", state, "--config", e.config, "--v=2")
	logf, err := os.Create(e.serveLog)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if cgroup != "" {
		if err := testutil.JoinCgroup(cgroup, cmd.Process.Pid); err != nil {
			_ = cmd.Process.Kill()
			t.Fatalf("moving the sidecar into %s: %v", cgroup, err)
		}
	}
	e.servePID = cmd.Process.Pid
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "serve.log"))
			t.Logf("mountplan-sidecar serve log:\n%s", b)
		}
	})
	if !testutil.Poll(10*time.Second, 10*time.Millisecond, func() bool {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
		}
		return err == nil
	}) {
		t.Fatal("mountplan-sidecar serve did not listen within 10s")
	}
	return state, sock
}
