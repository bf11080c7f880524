package e2e

// Two consumers of one volume in the same namespace, one writable and one
// read-only (SINGLE_NODE_WRITER allows both on one node, and a pod may mount
// a volume readOnly). Read-only belongs to the consumer's mount, not to the
// filesystem that the other consumer writes to.

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestPrepareReadOnlyBesideWriter(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	id := e.create("prep-ro", "", 16*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)
	watch := prepDevWatch(t, dev)
	ns := testutil.StartUnshare(t)
	rw := filepath.Join(e.dir, "rw")
	ro := filepath.Join(e.dir, "ro")
	for _, d := range []string{rw, ro} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var bugs []string
	cleanup := func() {
		for _, d := range []string{ro, rw} {
			e.mustSidecarUnmount(id, ns.PID, d)
		}
		e.wantNoConsumer(id)
		e.unstage(id)
		waitNoLoop(t, image)
		e.delete(id)
		ns.Kill()
		watch.check(t, dev.String()+" mounted")
	}

	for _, order := range [][2]string{{rw, ro}, {ro, rw}} {
		for _, d := range order {
			var extra []string
			if d == ro {
				extra = []string{"--readonly"}
			}
			if out, code := e.sidecarMount(id, ns.PID, d, extra...); code != 0 {
				if strings.Contains(out, "would change RO state") {
					bugs = append(bugs, "mounting "+filepath.Base(d)+" after "+filepath.Base(order[0])+": "+strings.TrimSpace(out))
					continue
				}
				t.Fatalf("mountplan-sidecar mount %s exited %d:\n%s", d, code, out)
			}
		}
		if len(bugs) == 0 {
			if _, err := ns.Exec(t, "sh", "-c", "echo w > "+rw+"/w && sync && cat "+ro+"/w"); err != nil {
				t.Errorf("write through %s, read through %s: %v", rw, ro, err)
			}
			if _, err := ns.Exec(t, "sh", "-c", "echo x > "+ro+"/x"); err == nil {
				t.Errorf("the read-only consumer could write")
			}
			if mi := prepMountAt(t, ns.PID, ro); mi == nil || !strings.HasPrefix(mi.Options, "ro,") {
				t.Errorf("read-only consumer's mount: %+v", mi)
			}
		}
		for _, d := range []string{ro, rw} {
			e.mustSidecarUnmount(id, ns.PID, d)
		}
		e.wantNoConsumer(id)
	}
	cleanup()
	if len(bugs) > 0 {
		t.Errorf("a read-only consumer cannot share a volume with a writable one: internal/mountns/options_linux.go "+
			"turns the plan's \"ro\" into the superblock flag ro (fsconfig) for every block filesystem, so the kernel refuses "+
			"to mount a superblock that is already mounted read-write (and the reverse):\n%s", strings.Join(bugs, "\n"))
	}
}
