//go:build linux

package mountns_test

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// tmpfsWith builds a detached tmpfs holding an empty file name.
func tmpfsWith(t *testing.T, name string) *os.File {
	t.Helper()
	fd, err := mountns.Build(plan.Mount{Type: "tmpfs", Source: name, Options: []string{"nosuid", "nodev", "size=1m"}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := unix.Openat(int(fd.Fd()), name, unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(f)
	return fd
}

// TestReplaceAt replaces the mount on top at a mount point inside another
// namespace with a new one, both ways (beneath, then detach; and detach,
// then attach where the kernel refuses beneath), and the old one is gone.
func TestReplaceAt(t *testing.T) {
	mountnstest.RequireRoot(t)
	for _, refuse := range []bool{false, true} {
		dir := mountnstest.Scratch(t)
		pid := mountnstest.Namespace(t, "private")
		old := tmpfsWith(t, "old")
		attachInto(t, pid, plan.Mount{Type: "tmpfs", Source: "ignored", Options: []string{"nosuid", "nodev"}}, dir) // a mount underneath
		target := filepath.Join(dir, "mp")
		if err := os.Mkdir(filepath.Join("/proc", strconv.Itoa(pid), "root", target), 0o750); err != nil {
			t.Fatal(err)
		}
		ns, err := mountns.OpenPID(pid, plan.Namespace{})
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.Do(func() error { return mountns.Attach(old, target) }); err != nil {
			t.Fatal(err)
		}
		old.Close()
		if refuse {
			mountns.RefuseBeneath(t)
		}
		repl := tmpfsWith(t, "new")
		var beneath bool
		err = ns.Do(func() error {
			root, err := mountns.OpenRoot("/")
			if err != nil {
				return err
			}
			defer root.Close()
			tf, err := root.Open(target)
			if err != nil {
				return err
			}
			defer tf.Close()
			beneath, err = ns.ReplaceAt(repl, tf, func() (*os.File, error) { return root.Open(target) })
			return err
		})
		repl.Close()
		ns.Close()
		if err != nil || beneath == refuse {
			t.Fatalf("ReplaceAt (beneath refused %t): beneath %t, %v", refuse, beneath, err)
		}
		var at []string
		for _, m := range mountnstest.MountsUnder(t, pid, target) {
			at = append(at, m.Source)
		}
		if len(at) != 1 || at[0] != "new" {
			t.Errorf("beneath refused %t: mounts at %s: %v, want only the new tmpfs", refuse, target, at)
		}
		if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid), "root", target, "new")); err != nil {
			t.Errorf("beneath refused %t: the new mount is not what %s shows: %v", refuse, target, err)
		}
	}
}
