package e2e

// A consumer's identity is its mount namespace, recorded by inode. The
// kernel recycles namespace inode numbers (the lowest free one is handed
// out next), so a namespace created after a consumer died often gets the
// dead consumer's number. This test makes that happen on purpose and checks
// that an unrelated namespace does not keep the dead consumer's claim alive.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestPrepareDeadConsumerNamespaceReused(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "unshare", "nsenter")
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})

	id := e.create("prep-nsreuse", "", 16*miB).GetVolumeId()
	image := loop.ImagePath(e.stateDir(), model.KindProvisioned, id)
	e.stage(id, mountCap("", rwo), nil)
	dev := e.stagedDevice(id, image)
	target := filepath.Join(e.dir, "consumer")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	ns := testutil.StartUnshare(t)
	e.mustSidecarMount(id, ns.PID, target)
	dead := e.wantConsumer(id, ns.PID, target)

	// The consumer dies without unmounting; its mount goes with it.
	ns.Kill()
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool { return len(prepNamespacesShowing(dev)) == 0 }) {
		t.Fatalf("the dead consumer's mount of %s did not go away", dev)
	}

	// An unrelated process gets a new mount namespace with the dead one's
	// inode number. Namespaces that get another number are kept alive, so
	// that the next one gets the next free number.
	var reuser *testutil.Proc
	for i := 0; i < 50 && reuser == nil; i++ {
		p := testutil.StartUnshare(t)
		if prepNSInode(t, p.PID) == dead.Namespace.Inode {
			reuser = p
		}
	}
	if reuser == nil {
		testutil.Missing(t, "a kernel that reuses mount namespace inodes: no new namespace got the dead consumer's inode %d within 50 tries", dead.Namespace.Inode)
	}
	t.Logf("pid %d (not a consumer) is in a new mount namespace with inode %d, the dead consumer's (pid %d)", reuser.PID, dead.Namespace.Inode, dead.PID)
	if hasMount(t, reuser.PID, target) {
		t.Fatalf("the new namespace has a mount at %s", target)
	}

	// The consumer is dead: NodeUnstageVolume must drop its claim and go on.
	err := e.tryUnstage(id)
	if status.Code(err) == codes.FailedPrecondition && strings.Contains(err.Error(), fmt.Sprintf("pid %d", dead.PID)) {
		// Leave nothing behind: with the unrelated namespace gone, the
		// claim is recognised as dead.
		reuser.Kill()
		e.unstage(id)
		waitNoLoop(t, image)
		e.delete(id)
		t.Errorf("NodeUnstageVolume refused because of dead consumer pid %d: an unrelated namespace (pid %d) reuses its "+
			"mount namespace inode %d, and internal/driver/prepare.go namespaceAlive treats any process in a namespace with that inode "+
			"as the consumer: %v", dead.PID, reuser.PID, dead.Namespace.Inode, err)
	}
	if err != nil {
		t.Fatalf("NodeUnstageVolume after the consumer died: %v", err)
	}
	e.wantNoConsumer(id)
	waitNoLoop(t, image)
	e.delete(id)
}
