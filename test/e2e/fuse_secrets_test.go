package e2e

// How secrets reach a FUSE daemon (issue 4, "Profiles"): as files, mode
// 0600, in a tmpfs private to the volume, named on the daemon's command
// line by path only; never in a command line, an environment, a log line
// or an error, even when the daemon itself prints them; and gone after
// unstage or a failed stage.

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/test/testutil"
)

// A profile whose "daemon" prints its secret and fails: the stage error
// quotes the daemon's log, which must come out redacted. As root: a daemon
// that mounts by itself as another user is refused before it runs where
// /dev/fuse is 0600 (no udev), and its log is the point here.
const fuseLeakyProfile = `- name: leaky
  binary: /bin/sh
  args: [-c, "echo starting; cat \"$1\"; echo; echo giving up >&2; exit 3", "{mountpoint}", "{secret:token}"]
  source: {pattern: 'anything'}
  secrets:
  - {name: token}
  readyTimeout: 5s
`

func TestFuseSecrets(t *testing.T) {
	fuseRequireFuse(t)
	testutil.RequireCommands(t, "sshfs")
	testutil.NoLeaks(t)
	s := startFuseSSHD(t)
	e := startFuseEnvWith(t, fuseLeakyProfile)
	pieces := fuseSecretLines(s.UserKey)
	vctx := map[string]string{"type": "fuse", "profile": "sshfs", "source": "root@127.0.0.1:" + s.Data, "port": strconv.Itoa(s.Port)}
	noSecret := func(what, text string) {
		t.Helper()
		for _, p := range pieces {
			if strings.Contains(text, p) {
				t.Errorf("%s holds a piece of the private key", what)
				return
			}
		}
	}

	// A failing stage: the server's host key does not match. The error
	// says why (the daemon's log) and nothing is left behind.
	id := "fuse-secrets"
	wrongHost := "[127.0.0.1]:1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE4AcDPJMrbvdEYdmQ2LqG1oD2CQ1Q2Y8UR1VtIDX0Y1\n"
	err := e.tryStage(id, mountCap("", rwo), vctx, map[string]string{"sshKey": s.UserKey, "knownHosts": wrongHost})
	t.Logf("stage with a wrong host key: %v", err)
	testutil.WantCode(t, "NodeStageVolume with a wrong host key", err, codes.Unavailable)
	if err != nil {
		noSecret("the stage error", err.Error())
		if !strings.Contains(err.Error(), "log ends with") {
			t.Errorf("the stage error does not quote the daemon's log: %v", err)
		}
	}
	e.checkClean(id)
	if _, err := e.record(id); err == nil {
		t.Error("the failed stage left a journal record")
	}

	// The daemon prints its secret: the error shows it redacted.
	const token = "CANARY-t0ken-9c1d2e3f4a5b"
	err = e.tryStage("fuse-leaky", mountCap("", rwo), map[string]string{"type": "fuse", "profile": "leaky", "source": "anything"}, map[string]string{"token": token})
	t.Logf("stage of a daemon that prints its secret: %v", err)
	if err == nil || strings.Contains(err.Error(), token) || !strings.Contains(err.Error(), "[redacted]") || !strings.Contains(err.Error(), "giving up") {
		t.Errorf("stage of a daemon that prints its secret: %v; want an error with the secret redacted", err)
	}
	e.checkClean("fuse-leaky")

	// A good stage: the files, their modes, their tmpfs.
	if err := e.tryStage(id, mountCap("", rwo), vctx, map[string]string{"sshKey": s.UserKey, "knownHosts": s.KnownHosts + "\n"}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.volDir(id), "secrets")
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(ms) != 1 || ms[0].FSType != "tmpfs" || !strings.Contains(ms[0].Options, "noexec") {
		t.Errorf("%s is not a tmpfs mount of its own: %+v %v", dir, ms, err)
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("%s: %v %v, want mode 0700", dir, fi.Mode(), err)
	}
	for name, want := range map[string]string{"sshKey": s.UserKey, "knownHosts": s.KnownHosts + "\n"} {
		p := filepath.Join(dir, name)
		fi, err := os.Stat(p)
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v, want a file of mode 0600", p, err)
			continue
		}
		if b, _ := os.ReadFile(p); string(b) != want {
			t.Errorf("%s does not hold the secret as given", p)
		}
	}
	d := e.daemon(id)
	cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(d.PID) + "/cmdline")
	if !strings.Contains(string(cmd), "IdentityFile="+filepath.Join(dir, "sshKey")) {
		t.Errorf("the daemon's command line does not name the key file: %q", cmd)
	}
	fuseCheckNoSecretInProcs(t, "while staged", pieces)
	if b, err := os.ReadFile(filepath.Join(e.volDir(id), "daemon.log")); err == nil {
		noSecret("the daemon's log", string(b))
	}
	jr, _ := os.ReadFile(filepath.Join(e.plugin.StateDir, "volumes", id+".json"))
	noSecret("the journal record", string(jr))
	if strings.Contains(string(jr), token) {
		t.Error("the journal record holds a secret")
	}
	e.unstage(id)
	e.checkClean(id)
	log := e.plugin.Log()
	noSecret("the plugin's log", log)
	if strings.Contains(log, token) {
		t.Error("the plugin's log holds the leaky daemon's secret")
	}
}
