package mounter_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
)

// loopsBackedBelow lists the loop devices whose backing file lies below
// dir, as the kernel shows them.
func loopsBackedBelow(t *testing.T, dir string) []string {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), dir+"/") {
			out = append(out, filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

// image makes an empty image of 1 MiB below dir/images.
func image(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, "images", name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestLoopLimit: with a bound of 2, a third AttachLoop is ResourceExhausted
// and attaches nothing; once one is detached, it succeeds. No device
// outlives the test.
func TestLoopLimit(t *testing.T) {
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/loop-control", "the loop driver")
	state := t.TempDir()
	t.Cleanup(func() {
		if left := loopsBackedBelow(t, state); len(left) > 0 {
			t.Errorf("loop devices left attached: %v", left)
		}
	})
	n := node(t, mounter.Bounds(mounter.Options{StateDir: state}, 2, 0, 0))
	ctx := context.Background()
	attach := func(name string) (mounter.Loop, error) {
		l, err := n.AttachLoop(ctx, mounter.LoopRequest{Image: image(t, state, name)})
		if err == nil {
			t.Cleanup(func() {
				if err := n.DetachLoop(ctx, l.Identity); err != nil {
					t.Errorf("detach %s: %v", l.Path, err)
				}
				waitDetached(t, l.Path)
			})
		}
		return l, err
	}
	first, err := attach("a.img")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := attach("b.img"); err != nil {
		t.Fatal(err)
	}
	l, err := attach("c.img")
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a third loop device with a limit of 2: %+v, %v; want ResourceExhausted", l, err)
	}
	t.Logf("refused: %v", err)
	if got := loopsBackedBelow(t, state); len(got) != 2 {
		t.Fatalf("loop devices attached after the refusal: %v, want the first two only", got)
	}
	if err := n.DetachLoop(ctx, first.Identity); err != nil {
		t.Fatal(err)
	}
	waitDetached(t, first.Path)
	if _, err := attach("c.img"); err != nil {
		t.Fatalf("AttachLoop once a device was detached: %v", err)
	}
}

// TestChainTmpfsSize: a chain's tmpfs upper carries size=, Options'
// or the default.
func TestChainTmpfsSize(t *testing.T) {
	mountnstest.RequireRoot(t)
	testenv.RequireFile(t, "/dev/loop-control", "the loop driver")
	mountnstest.RequireTool(t, "mkfs.erofs")
	for _, tc := range []struct {
		size int64
		want string
	}{{8 << 20, "size=8192k"}, {0, "size=1048576k"}} {
		t.Run(tc.want, func(t *testing.T) {
			state := mountnstest.Scratch(t)
			n := node(t, mounter.Bounds(mounter.Options{StateDir: state}, 0, 0, tc.size))
			lower := erofsDevice(t, n, state)
			ctx := context.Background()
			c, err := n.BuildChain(ctx, mounter.ChainRequest{VolumeID: "vol-1", Lower: lower, LowerType: "erofs"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := n.TeardownChain(ctx, "vol-1"); err != nil {
					t.Errorf("TeardownChain: %v", err)
				}
			})
			opts := superOptions(t, c.Upper)
			if !strings.Contains(","+opts+",", ","+tc.want+",") {
				t.Errorf("the chain's tmpfs upper at %s has options %q, want %s", c.Upper, opts, tc.want)
			}
		})
	}
}

// erofsDevice makes an erofs image below state/images and has n attach it.
func erofsDevice(t *testing.T, n *mounter.Local, state string) mounter.Device {
	t.Helper()
	content := t.TempDir()
	if err := os.WriteFile(filepath.Join(content, "f"), []byte("lower"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(state, "images", "lower.erofs")
	if err := os.MkdirAll(filepath.Dir(img), 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.erofs", "--quiet", img, content).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	ctx := context.Background()
	l, err := n.AttachLoop(ctx, mounter.LoopRequest{Image: img, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.DetachLoop(ctx, l.Identity); err != nil {
			t.Errorf("detach %s: %v", l.Path, err)
		}
		waitDetached(t, l.Path)
	})
	return l.Device
}

// superOptions returns the superblock options of the mount at p in this
// process's mountinfo (the topmost, if stacked).
func superOptions(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	opts := ""
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 5 && f[4] == p {
			opts = f[len(f)-1]
		}
	}
	if opts == "" {
		t.Fatalf("nothing mounted at %s", p)
	}
	return opts
}
