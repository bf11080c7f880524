package e2e

// Bad input to the prepare flow, through the sidecar (exit status, message)
// and through the NodePrepare API directly (gRPC code): clear errors, no
// claim recorded in the journal, nothing mounted anywhere, nothing leaked.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestPrepareBadInput(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})

	staged := e.create("prep-bad-staged", "", 16*miB).GetVolumeId()
	stagedImage := loop.ImagePath(e.stateDir(), model.KindProvisioned, staged)
	e.stage(staged, mountCap("", rwo), nil)
	dev := e.stagedDevice(staged, stagedImage)
	watch := prepDevWatch(t, dev)
	unstaged := e.create("prep-bad-unstaged", "", 16*miB).GetVolumeId()
	const unknown = "prep-no-such-volume"

	ns := testutil.StartUnshare(t)
	target := filepath.Join(e.dir, "consumer")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	nsBefore, err := testutil.MountInfoOf(ns.PID)
	if err != nil {
		t.Fatal(err)
	}
	noPID := prepNoPID(t)

	cases := []struct {
		name       string
		volume     string
		pid        int
		target     string
		block      bool
		code       codes.Code
		sidecarMsg []string // the sidecar's message mentions these
	}{
		{name: "no such pid", volume: staged, pid: noPID, target: target, code: codes.NotFound,
			sidecarMsg: []string{fmt.Sprintf("process %d does not exist", noPID)}},
		{name: "target with ..", volume: staged, pid: ns.PID, target: target + "/../escape", code: codes.InvalidArgument,
			sidecarMsg: []string{"clean absolute path"}},
		{name: "relative target", volume: staged, pid: ns.PID, target: "data", code: codes.InvalidArgument,
			sidecarMsg: []string{"clean absolute path"}},
		{name: "not staged", volume: unstaged, pid: ns.PID, target: target, code: codes.FailedPrecondition,
			sidecarMsg: []string{"not staged"}},
		{name: "unknown volume", volume: unknown, pid: ns.PID, target: target, code: codes.NotFound,
			sidecarMsg: []string{unknown, "not found"}},
		{name: "block access to a mount volume", volume: staged, pid: ns.PID, target: target, block: true,
			code: codes.InvalidArgument, sidecarMsg: []string{"staged for mount access"}},
	}
	for _, tc := range cases {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			e := e.with(t)
			var extra []string
			if tc.block {
				extra = append(extra, "--block")
			}
			out, code := e.sidecarMount(tc.volume, tc.pid, tc.target, extra...)
			if code != 1 {
				t.Errorf("mountplan-sidecar mount exited %d, want 1 (an error, not a usage error)", code)
			}
			for _, s := range tc.sidecarMsg {
				if !strings.Contains(out, s) {
					t.Errorf("mountplan-sidecar's message does not mention %q:\n%s", s, out)
				}
			}
			c := mountCap("", rwo)
			if tc.block {
				c = blockCap(rwo)
			}
			_, err := e.prepare(tc.volume, c, tc.pid, tc.target)
			testutil.WantCode(t, "NodePrepareVolume", err, tc.code)
			for _, id := range []string{staged, unstaged} {
				e.wantNoConsumer(id)
			}
			e.noRecord(unknown)
		})
	}

	// A PID that is no longer in the namespace the caller names (a reused
	// PID) is refused, through the sidecar and the API.
	hostNS := prepNSInode(t, os.Getpid())
	out, code := e.sidecarMount(staged, ns.PID, target, "--mnt-ns-inode", fmt.Sprint(hostNS))
	if code != 1 || !strings.Contains(out, fmt.Sprintf("no longer in mount namespace %d", hostNS)) {
		t.Errorf("mount with a stale --mnt-ns-inode: exit %d:\n%s", code, out)
	}
	_, err = e.np.NodePrepareVolume(e.ctx(), &api.NodePrepareVolumeRequest{VolumeId: staged, StagingTargetPath: e.staging(staged),
		VolumeCapability: mountCap("", rwo), Consumer: &api.Consumer{Pid: int64(ns.PID), MountPoint: target, MntNsInode: hostNS}})
	testutil.WantCode(t, "NodePrepareVolume with a stale mnt_ns_inode", err, codes.FailedPrecondition)

	// --pid 0 is documented by the sidecar as "the sidecar's own
	// namespace", but the plugin requires a positive PID.
	out, code = e.sidecarMount(staged, 0, target)
	if code == 0 {
		t.Errorf("mountplan-sidecar mount --pid 0 mounted into the sidecar's (the host's) namespace:\n%s", out)
		e.mustSidecarUnmount(staged, 0, target)
	} else if !strings.Contains(out, "consumer.pid must be a positive process id") {
		t.Errorf("mountplan-sidecar mount --pid 0: exit %d:\n%s", code, out)
	}
	// The sidecar's own command-line checks: usage errors exit 2 before
	// anything reaches the plugin.
	if out, code := e.runSidecar("mount", "--plugin-endpoint", e.plugin.Endpoint, "--volume-id", staged, "--pid", fmt.Sprint(ns.PID)); code != 2 ||
		!strings.Contains(out, "--staging-path is required") {
		t.Errorf("mount without --staging-path and --target: exit %d, want 2:\n%s", code, out)
	}

	// Nothing happened anywhere: no claim, no mount in the namespace or on
	// the host, nothing created in the consumer's directory or beside it.
	e.wantNoConsumer(staged)
	e.wantNoConsumer(unstaged)
	nsAfter, err := testutil.MountInfoOf(ns.PID)
	if err != nil {
		t.Fatal(err)
	}
	if len(nsAfter) != len(nsBefore) {
		t.Errorf("the namespace's mount table changed: %d mounts before, %d after", len(nsBefore), len(nsAfter))
	}
	prepCheckHostClean(t, "after the bad requests", dev)
	if ents, err := os.ReadDir(target); err != nil || len(ents) != 0 {
		t.Errorf("consumer directory %s: %v, %v; want it empty", target, ents, err)
	}
	for _, p := range []string{filepath.Join(e.dir, "escape"), filepath.Join(target, "data")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s was created", p)
		}
	}
	if v := e.mustRecord(unstaged); v.Stage != nil {
		t.Errorf("the unstaged volume got staged: %+v", v.Stage)
	}
	if ls := plugLoopsBackedBy(t, loop.ImagePath(e.stateDir(), model.KindProvisioned, unstaged)); len(ls) != 0 {
		t.Errorf("the unstaged volume's image is attached to %v", ls)
	}

	e.unstage(staged)
	waitNoLoop(t, stagedImage)
	e.delete(staged)
	e.delete(unstaged)
	ns.Kill()
	watch.check(t, dev.String()+" mounted")
}
