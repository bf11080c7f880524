package e2e

// Helpers of the TestFuse* tests (FUSE volumes): the shared harness
// (env_test.go) with the example profiles of internal/source/fuse/testdata, the
// real daemons from Debian's packages (sshfs against an sshd started here,
// rclone, squashfuse), and views of the kernel and of the daemons that do
// not go through the product.

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/source/fuse"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/test/testutil"
)

// fuseProfilesPath is the example config that README documents.
func fuseProfilesPath(t *testing.T) string {
	root, err := testutil.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "internal", "source", "fuse", "testdata", "profiles.yaml")
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

// volumeDaemons are the processes serving volume id: those naming its
// mount point, and those of fd mode, whose mount point is the descriptor
// the mounter handed them (fuseprofile.FdMountPoint), naming the
// volume's source instead.
func (e *fuseEnv) volumeDaemons(id string, vctx map[string]string) map[int]string {
	ps := processesMentioning(e.volDir(id) + "/mnt")
	for pid, cmdline := range processesMentioning(vctx["source"]) {
		if slices.Contains(strings.Fields(cmdline), fuseprofile.FdMountPoint) {
			ps[pid] = cmdline
		}
	}
	return ps
}

// volDir is the volume's directory under the state dir.
func (e *fuseEnv) volDir(id string) string { return filepath.Join(e.plugin.StateDir, "fuse", id) }

// daemon is the daemon the journal records for id: the supervisor
// records every incarnation there.
func (e *fuseEnv) daemon(id string) fuse.Daemon {
	e.t.Helper()
	return e.state(id).Daemon
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
	if ps := processesMentioning(dir); len(ps) > 0 {
		e.t.Errorf("processes left that name %s: %v", dir, ps)
	}
}

// fuseAlive reports whether d's process still runs (same start time).
func fuseAlive(d fuse.Daemon) bool { return d.Alive() }

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
	dir := testutil.MarkedTempDir(t, "mpsshd-")
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
		s.Port = nbdtest.FreePort(t)
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

// fuseEnv is the shared harness (env) with the example profiles of
// internal/source/fuse/testdata in its config, their roots pointed at test
// directories.
type fuseEnv struct {
	*env
	// roots replace the example config's /srv/rclone and /srv/squashfs.
	rcloneRoot, squashRoot string
}

// newFuseEnv writes the example config (with more profiles, YAML list
// items, appended) with the roots pointed at test directories; it starts
// nothing.
func newFuseEnv(t *testing.T, moreProfiles string) *fuseEnv {
	t.Helper()
	dir := t.TempDir()
	e := &fuseEnv{rcloneRoot: filepath.Join(dir, "rclone-root"), squashRoot: filepath.Join(dir, "squash-root")}
	for _, d := range []string{e.rcloneRoot, e.squashRoot} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A daemon in fd mode runs as nobody (squashfuse's): it must reach
	// the images through the test's directories.
	for d := dir; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(fuseProfilesPath(t))
	if err != nil {
		t.Fatal(err)
	}
	e.env = newEnv(t, strings.NewReplacer("/srv/rclone", e.rcloneRoot, "/srv/squashfs", e.squashRoot).Replace(string(b))+moreProfiles)
	return e
}

// startFuseEnv starts the plugin with the example config, --v=5 and args;
// the plugin runs the daemons and performs plans itself.
func startFuseEnv(t *testing.T, args ...string) *fuseEnv {
	t.Helper()
	return startFuseEnvWith(t, "", args...)
}

// startFuseEnvWith is startFuseEnv with more profiles in the config.
func startFuseEnvWith(t *testing.T, moreProfiles string, args ...string) *fuseEnv {
	t.Helper()
	e := newFuseEnv(t, moreProfiles)
	e.startPlugin("", append([]string{"--v=5"}, args...)...)
	return e
}

// startFuseEnvServe starts `mountplan-sidecar serve` and the plugin with it
// as its mounter: kubelet's publishes, the re-attach of healed consumers
// and the FUSE daemons go through the sidecar's process.
func startFuseEnvServe(t *testing.T, args ...string) *fuseEnv {
	t.Helper()
	e := newFuseEnv(t, "")
	e.startMounter("")
	e.startPlugin("", append([]string{"--v=5"}, args...)...)
	return e
}
