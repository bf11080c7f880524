package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/test/testutil"
)

// netblkPlugin starts the real plugin binary with an admin config and
// returns its node client and state dir.
func netblkPlugin(t *testing.T, config string) (csi.NodeClient, string) {
	t.Helper()
	plugin, _ := testutil.BuildBinaries(t)
	cfgDir := t.TempDir()
	cfgPath := filepath.Join(cfgDir, "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	p := testutil.StartPlugin(t, plugin, "--config", cfgPath)
	conn, err := endpoint.Dial(p.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return csi.NewNodeClient(conn), p.StateDir
}

func netblkStage(node csi.NodeClient, stateDir, id string, vctx, secrets map[string]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id,
		StagingTargetPath: filepath.Join(stateDir, "staging", id),
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}},
		VolumeContext: vctx, Secrets: secrets})
	return err
}

// withoutModuleRow returns rows without their first, which expects the
// kernel to lack module, when this kernel has it: a real attach is what
// make test-vm tests.
func withoutModuleRow[R any](t *testing.T, module string, rows []R) []R {
	t.Helper()
	if _, err := os.Stat("/sys/module/" + module); err == nil {
		t.Logf("this kernel has %s: the valid volume's stage is make test-vm's; the other rows run", module)
		return rows[1:]
	}
	return rows
}

// netblkNoRecords fails when the journal kept a record of a failed stage.
func netblkNoRecords(t *testing.T, stateDir string) {
	t.Helper()
	recs, _ := filepath.Glob(filepath.Join(stateDir, "volumes", "*.json"))
	if len(recs) != 0 {
		t.Fatalf("journal records left after failed stages: %v", recs)
	}
}

// TestNBDPluginWithoutKernelSupport drives the real plugin binary against
// a real nbdkit on loopback. On a kernel without the nbd module (CI's) a
// valid volume fails with FailedPrecondition naming the module (on one with
// it, that row is make test-vm's); bad input is refused with its own code;
// nothing is left behind.
func TestNBDPluginWithoutKernelSupport(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "vol", 32<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	node, stateDir := netblkPlugin(t, "nbd:\n  allowedServers: [\"127.0.0.1:*\"]\n  timeoutSeconds: 5\n")
	type row struct {
		name string
		vctx map[string]string
		code codes.Code
		says string
	}
	for _, tc := range withoutModuleRow(t, "nbd", []row{
		{"valid volume, kernel without nbd", map[string]string{"type": "nbd", "address": srv.Address, "export": "vol"}, codes.FailedPrecondition, "module nbd"},
		{"address not allowed", map[string]string{"type": "nbd", "address": fmt.Sprintf("127.0.0.2:%d", srv.Port), "export": "vol"}, codes.InvalidArgument, "nbd.allowedServers"},
		{"socket outside the roots", map[string]string{"type": "nbd", "address": "/run/x.sock", "export": "vol"}, codes.InvalidArgument, "socketRoots"},
		{"missing export", map[string]string{"type": "nbd", "address": srv.Address, "export": "nope"}, codes.NotFound, `"nope"`},
		{"no server", map[string]string{"type": "nbd", "address": fmt.Sprintf("127.0.0.1:%d", nbdtest.FreePort(t)), "export": "vol"}, codes.Unavailable, "unreachable"},
	}) {
		err := netblkStage(node, stateDir, "nbd-e2e", tc.vctx, nil)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.code, tc.says)
		}
	}
	netblkNoRecords(t, stateDir)
}
