package e2e

import (
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/internal/source/iscsi"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestISCSIPluginWithoutKernelSupport drives the real plugin binary against
// a real tgtd on loopback: discovery runs, then on a kernel without
// iscsi_tcp (CI's) a valid volume fails with FailedPrecondition naming the
// module (on one with it, that row is make test-vm's); bad input is refused
// with its own code; the CHAP password is in no error; nothing is left
// behind.
func TestISCSIPluginWithoutKernelSupport(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{16 << 20}})
	node, stateDir := netblkPlugin(t, "iscsi:\n  allowedPortals: [\"127.0.0.1:*\"]\n  deviceTimeoutSeconds: 10\n")
	const password = "canary-e2e-secret"
	secrets := map[string]string{iscsi.SecretUsername: "u", iscsi.SecretPassword: password}
	port := tg.Portal[strings.LastIndexByte(tg.Portal, ':')+1:]
	type row struct {
		name    string
		vctx    map[string]string
		secrets map[string]string
		code    codes.Code
		says    string
	}
	for _, tc := range withoutModuleRow(t, "iscsi_tcp", []row{
		{"valid volume, kernel without iscsi_tcp", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "1"}, secrets, codes.FailedPrecondition, "module iscsi_tcp"},
		{"portal not allowed", map[string]string{"type": "iscsi", "portals": "127.0.0.2:" + port, "iqn": tg.IQN, "lun": "1"}, secrets, codes.InvalidArgument, "iscsi.allowedPortals"},
		{"target not offered", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN + ".other", "lun": "1"}, secrets, codes.NotFound, "not found"},
		{"bad lun", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "x"}, secrets, codes.InvalidArgument, "lun"},
		{"password without user", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "1"}, map[string]string{iscsi.SecretPassword: password}, codes.InvalidArgument, "CHAP"},
	}) {
		err := netblkStage(node, stateDir, "iscsi-e2e", tc.vctx, tc.secrets)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.code, tc.says)
		}
		if err != nil && strings.Contains(err.Error(), password) {
			t.Errorf("%s: the error shows the CHAP password", tc.name)
		}
	}
	netblkNoRecords(t, stateDir)
	if recs, _ := os.ReadDir("/etc/iscsi/nodes"); len(recs) != 0 {
		t.Errorf("node records written: %v", recs)
	}
}
