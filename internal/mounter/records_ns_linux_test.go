package mounter_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

const recordsChildEnv = "MOUNTPLAN_RECORDS_CHILD"

// TestRecordsInAnotherNamespace: a mounter restarted in a new container is
// in a new mount namespace, where every mount it recorded has another
// mount ID, and so is a one-shot command reading its records. Both take
// the records back by the filesystem and root inode found at each path:
// a recorded mount stays a bind source there (the cluster's FUSE volumes
// lost their secrets after a mounter restart without this), a mount the
// mounter never made does not become one.
func TestRecordsInAnotherNamespace(t *testing.T) {
	if env := os.Getenv(recordsChildEnv); env != "" {
		recordsChild(t, env)
		return
	}
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "unshare")
	dir := mountnstest.Scratch(t)
	state, records := filepath.Join(dir, "state"), filepath.Join(dir, "records")
	made, foreign := filepath.Join(state, "fuse", "v", "mnt"), filepath.Join(state, "other")
	mkdirs(t, made, foreign)
	n := node(t, mounter.Options{StateDir: state, KubeletDir: state, RecordsDir: records})
	for _, p := range []string{made, foreign} {
		if err := unix.Mount("mountplan-test", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = mountns.Unmount(p, true) })
	}
	if err := mounter.RecordMount(n, "fuse", made); err != nil {
		t.Fatal(err)
	}
	for _, observe := range []string{"serve", "observe"} {
		cmd := exec.Command("unshare", "-m", "--propagation", "unchanged", os.Args[0], "-test.run=^TestRecordsInAnotherNamespace$", "-test.v")
		cmd.Env = append(os.Environ(), recordsChildEnv+"="+strings.Join([]string{observe, state, records, made, foreign}, ":"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("a %s mounter in a new mount namespace: %v\n%s", observe, err, out)
		}
	}
}

// recordsChild is the mounter in the new namespace.
func recordsChild(t *testing.T, env string) {
	f := strings.Split(env, ":")
	mode, state, records, made, foreign := f[0], f[1], f[2], f[3], f[4]
	n, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: state, KubeletDir: state, RecordsDir: records, Observe: mode == "observe"})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if err := mounter.CheckBindSource(n, made); err != nil {
		t.Errorf("the recorded mount %s as a bind source: %v", made, err)
	}
	if err := mounter.CheckBindSource(n, foreign); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("a mount the mounter never made (%s) as a bind source: %v, want PermissionDenied", foreign, err)
	}
}
