//go:build linux

package mountns_test

import (
	"errors"
	"os"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestIdentityOf(t *testing.T) {
	self, err := mountns.Self()
	if err != nil {
		t.Fatal(err)
	}
	got, err := mountns.IdentityOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got != self.Identity() || got.Inode == 0 {
		t.Fatalf("IdentityOf(self) = %+v, Self().Identity() = %+v", got, self.Identity())
	}
	if _, err := mountns.IdentityOf(1<<22 + 1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("IdentityOf(no such pid) = %v, want NotFound", err)
	}
	if _, err := mountns.IdentityOf(0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("IdentityOf(0) = %v, want InvalidArgument", err)
	}
	if _, ok, err := mountns.Find(plan.Namespace{}); ok || err != nil {
		t.Fatalf("Find(zero identity) = %v, %v; want nothing", ok, err)
	}
	if pid, ok, err := mountns.Find(got); !ok || err != nil {
		t.Fatalf("Find(own namespace) = %d, %v, %v", pid, ok, err)
	} else if id, err := mountns.IdentityOf(pid); err == nil && !got.Matches(id) {
		t.Fatalf("Find(own namespace) = pid %d in %+v, want %+v", pid, id, got)
	}
}

// TestFindThroughAnotherProcess: a namespace outlives the process it was
// recorded by, and is found (and opened) through the one left in it, and
// reported gone once none is.
func TestFindThroughAnotherProcess(t *testing.T) {
	mountnstest.RequireRoot(t)
	s := mountnstest.NewSharedNamespace(t, "private")
	id, err := mountns.IdentityOf(s.First)
	if err != nil {
		t.Fatal(err)
	}
	if second, err := mountns.IdentityOf(s.Second); err != nil || second != id {
		t.Fatalf("second process in %+v (%v), want %+v", second, err, id)
	}
	if id.ID == 0 {
		t.Log("kernel lacks NS_GET_MNTNS_ID: finding by inode only")
	}

	s.KillFirst()
	if _, err := mountns.OpenPID(s.First, id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("OpenPID(dead pid) = %v, want NotFound", err)
	}
	pid, ok, err := mountns.Find(id)
	if err != nil || !ok || pid != s.Second {
		t.Fatalf("Find = %d, %v, %v; want the second process %d", pid, ok, err, s.Second)
	}
	ns, err := mountns.OpenIdentity(id)
	if err != nil {
		t.Fatal(err)
	}
	if ns.Identity() != id || ns.IsSelf() {
		t.Fatalf("OpenIdentity opened %+v (self %v), want %+v", ns.Identity(), ns.IsSelf(), id)
	}
	ns.Close()

	s.KillSecond(t)
	if pid, ok, err := mountns.Find(id); ok || err != nil {
		t.Fatalf("Find after the last process exited = %d, %v, %v; want nothing", pid, ok, err)
	}
	if _, err := mountns.OpenIdentity(id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("OpenIdentity after the last process exited = %v, want NotFound", err)
	}
}
