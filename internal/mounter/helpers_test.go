package mounter_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

var safe = []string{"nosuid", "nodev"}

func opts(extra ...string) []string { return append(append([]string{}, safe...), extra...) }

func tmpfs(label, target string, extra ...string) plan.Mount {
	return plan.Mount{Type: "tmpfs", Source: label, Target: target, Options: opts(extra...)}
}

// executor is a node over the state dir root (a temp dir when none is
// given) that also takes consumers in its own namespace (as kubelet's
// publishes) below it; its records live in a temp dir of the test's.
func executor(t testing.TB, root ...string) *mounter.Local {
	t.Helper()
	o := mounter.Options{}
	if len(root) > 0 {
		o.StateDir = root[0]
	}
	return node(t, o)
}

// node makes a Local node with o, filling in what o leaves empty: the state
// dir and kubelet dir (one temp dir), the records dir, an empty config.
func node(t testing.TB, o mounter.Options) *mounter.Local {
	t.Helper()
	if o.StateDir == "" {
		o.StateDir = t.TempDir()
	}
	if o.KubeletDir == "" {
		o.KubeletDir = o.StateDir
	}
	if o.RecordsDir == "" {
		o.RecordsDir = filepath.Join(t.TempDir(), "records")
	}
	if o.Config == nil {
		o.Config = &config.Config{}
	}
	n, err := mounter.NewNode(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

// volumeDevice makes an image of sizeMiB under n's image root
// (<state>/images), with an fstype filesystem unless fstype is empty,
// and has n attach it, as a stage does; cleanup detaches it.
func volumeDevice(t testing.TB, n *mounter.Local, stateDir, fstype string, sizeMiB int) string {
	t.Helper()
	dir := filepath.Join(stateDir, "images")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	img, err := os.CreateTemp(dir, "img-*.raw")
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if err := img.Truncate(int64(sizeMiB) << 20); err != nil {
		t.Fatal(err)
	}
	if fstype != "" {
		if out, err := exec.Command("mkfs."+fstype, mkfsArgs(fstype, img.Name())...).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.%s: %v: %s", fstype, err, out)
		}
	}
	l, err := n.AttachLoop(context.Background(), mounter.LoopRequest{Image: img.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.DetachLoop(context.Background(), l.Identity); err != nil {
			t.Errorf("detach %s: %v", l.Path, err)
		}
		waitDetached(t, l.Path)
	})
	return l.Path
}

func mkfsArgs(fstype, img string) []string {
	switch fstype {
	case "xfs":
		return []string{"-q", "-f", img}
	case "ext4":
		return []string{"-q", "-F", img}
	}
	return []string{img}
}

// waitDetached waits until the kernel let go of dev (a detach of a device
// someone still has open, as a probe, is deferred).
func waitDetached(t testing.TB, dev string) {
	t.Helper()
	for range 500 {
		b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
		if err != nil || len(b) == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Errorf("%s is still attached", dev)
}
