package e2e

// What a PV or pod author can get wrong, or try on purpose, with a FUSE
// volume: each is refused with InvalidArgument before any process starts
// or anything is created, and no error names a secret's value.

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/toolrun"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestFuseBadInput(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startFuseEnv(t)
	const canary = "CANARY-b4d1nput-5ecret-7f3a9c"
	okSecrets := map[string]string{"sshKey": canary, "knownHosts": canary}
	inRoot := filepath.Join(e.rcloneRoot, "share")
	if err := os.Mkdir(inRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(e.rcloneRoot, "escape")); err != nil {
		t.Fatal(err)
	}
	ssh := func(source string, more ...string) map[string]string {
		m := map[string]string{"type": "fuse", "profile": "sshfs", "source": source}
		for i := 0; i+1 < len(more); i += 2 {
			m[more[i]] = more[i+1]
		}
		return m
	}
	cases := []struct {
		name    string
		vctx    map[string]string
		secrets map[string]string
	}{
		{"no profile", map[string]string{"type": "fuse", "source": "root@127.0.0.1:/srv"}, okSecrets},
		{"unknown profile", map[string]string{"type": "fuse", "profile": "nfs", "source": "root@127.0.0.1:/srv"}, okSecrets},
		{"no source", map[string]string{"type": "fuse", "profile": "sshfs"}, okSecrets},
		{"option not allowed", ssh("root@127.0.0.1:/srv", "ssh_command", "sh"), okSecrets},
		{"option naming an argument", ssh("root@127.0.0.1:/srv", "-o", "ProxyCommand=sh"), okSecrets},
		{"option value not allowed", ssh("root@127.0.0.1:/srv", "cache", "maybe"), okSecrets},
		{"option value injecting an option", ssh("root@127.0.0.1:/srv", "port", "22,ProxyCommand=sh"), okSecrets},
		{"source with ;", ssh("root@127.0.0.1:/srv;touch /tmp/pwned"), okSecrets},
		{"source with $()", ssh("root@127.0.0.1:/srv$(id)"), okSecrets},
		{"source with backquotes", ssh("root@127.0.0.1:/`id`"), okSecrets},
		{"source with a pipe", ssh("root@127.0.0.1:/srv|sh"), okSecrets},
		{"source with a space", ssh("root@127.0.0.1:/srv -oProxyCommand=sh"), okSecrets},
		{"source with a newline", ssh("root@127.0.0.1:/srv\n-oProxyCommand=sh"), okSecrets},
		{"source that is a flag", ssh("-oProxyCommand=sh"), okSecrets},
		{"source with a comma", ssh("root@127.0.0.1:/srv,ssh_command=sh"), okSecrets},
		{"source not matching the profile", ssh("/etc"), okSecrets},
		{"missing secret", ssh("root@127.0.0.1:/srv"), map[string]string{"sshKey": canary}},
		{"secret the profile does not take", ssh("root@127.0.0.1:/srv"), map[string]string{"sshKey": canary, "knownHosts": canary, "password": canary}},
		{"path source outside the roots", map[string]string{"type": "fuse", "profile": "rclone", "source": "/etc"}, nil},
		{"path source with ..", map[string]string{"type": "fuse", "profile": "rclone", "source": inRoot + "/../../x"}, nil},
		{"path source escaping by symlink", map[string]string{"type": "fuse", "profile": "rclone", "source": filepath.Join(e.rcloneRoot, "escape")}, nil},
		{"the root itself", map[string]string{"type": "fuse", "profile": "rclone", "source": e.rcloneRoot}, nil},
	}
	fuseDir := filepath.Join(e.plugin.StateDir, "fuse")
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := "bad-" + strings.ReplaceAll(strings.ToLower(c.name), " ", "-")
			id = strings.Map(func(r rune) rune {
				if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' {
					return r
				}
				return '-'
			}, id)
			err := e.tryStage(id, mountCap("", rwo), c.vctx, c.secrets)
			testutil.WantCode(t, "NodeStageVolume", err, codes.InvalidArgument)
			if err != nil && strings.Contains(err.Error(), canary) {
				t.Errorf("the error names a secret's value: %v", err)
			}
			if i < 3 || testing.Verbose() {
				t.Logf("refused: %v", err)
			}
			if _, err := os.Lstat(filepath.Join(fuseDir, id)); err == nil {
				t.Errorf("the refused stage created %s", filepath.Join(fuseDir, id))
			}
			if ps := fuseChildrenOf(e.plugin.PID()); len(ps) > 0 {
				t.Errorf("the refused stage started processes: %v", ps)
			}
			if _, err := e.record(id); err == nil {
				t.Errorf("the refused stage left a journal record")
			}
		})
	}
	// Block access makes no sense for a FUSE volume.
	_, err := e.node.NodeStageVolume(e.ctx(), &csi.NodeStageVolumeRequest{VolumeId: "bad-block", StagingTargetPath: e.staging("bad-block"),
		VolumeCapability: &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}},
		VolumeContext: map[string]string{"type": "fuse", "profile": "rclone", "source": inRoot}})
	testutil.WantCode(t, "NodeStageVolume for block access", err, codes.InvalidArgument)
	if ps := fuseChildrenOf(e.plugin.PID()); len(ps) > 0 {
		t.Errorf("refused stages started processes: %v", ps)
	}
	if strings.Contains(e.plugin.Log(), canary) {
		t.Error("the plugin's log holds a secret's value")
	}
}

// isToolSpawner tells the plugin's tool spawner (internal/toolrun), a child it
// has from its start, from the processes a stage starts.
func isToolSpawner(pid string) bool {
	cmdline, _ := os.ReadFile("/proc/" + pid + "/cmdline")
	argv0, _, _ := strings.Cut(string(cmdline), "\x00")
	return argv0 == toolrun.SpawnerName
}

// fuseChildrenOf returns the live processes whose parent is pid, but for
// the plugin's tool spawner.
func fuseChildrenOf(pid int) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, ent := range ents {
		stat, err := os.ReadFile("/proc/" + ent.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(stat)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(pid) && f[0] != "Z" && !isToolSpawner(ent.Name()) {
			n, _ := strconv.Atoi(ent.Name())
			out[n] = s[:i+1]
		}
	}
	return out
}
