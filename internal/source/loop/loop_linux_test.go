package loop

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/sourcetest"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/testutil"
)

// readOnlyImage builds an image of kind (squashfs or erofs) holding hello.txt.
func readOnlyImage(t *testing.T, dir, kind string) string {
	t.Helper()
	content := filepath.Join(dir, "content")
	if err := os.MkdirAll(content, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("from the image\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, kind+".img")
	var cmd *exec.Cmd
	switch kind {
	case "squashfs":
		testutil.RequireCommands(t, "mksquashfs")
		cmd = exec.Command("mksquashfs", content, img, "-quiet", "-noappend")
	case "erofs":
		testutil.RequireCommands(t, "mkfs.erofs")
		cmd = exec.Command("mkfs.erofs", "--quiet", img, content)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", cmd, err, out)
	}
	return img
}

// TestOverlayChain stages a read-only image with a writable overlay, mounts
// the plan, writes through it, and proves unstage removes every layer.
func TestOverlayChain(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct{ kind, upperSize string }{{"squashfs", ""}, {"erofs", strconv.Itoa(32 << 20)}} {
		t.Run(tc.kind, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "mp-chain-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = os.RemoveAll(dir) })
			testutil.NoLeaks(t, dir)
			ctx := context.Background()
			stateDir := filepath.Join(dir, "state")
			node := newNode(t, stateDir, dir)
			s := New(stateDir, node)
			v := source.Volume{ID: "chain-" + tc.kind, Kind: model.KindStatic, Image: readOnlyImage(t, dir, tc.kind),
				Parameters: map[string]string{ParamOverlay: "true", ParamUpperSize: tc.upperSize}}
			if tc.upperSize == "" {
				delete(v.Parameters, ParamUpperSize)
			}
			raw, err := s.Stage(ctx, v, source.StageRequest{FsType: "ext4", Record: &sourcetest.Recorder{}})
			if err != nil {
				t.Fatalf("Stage: %v", err)
			}
			v = sourcetest.Staged(v, raw)
			var st State
			if err := json.Unmarshal(raw, &st); err != nil || st.Chain == nil || st.FsType != tc.kind {
				t.Fatalf("state %s: %v", raw, err)
			}
			mounts, err := s.Plan(v, source.PlanRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if len(mounts) != 1 || mounts[0].Type != plan.TypeBind || mounts[0].Source != st.Chain.Merged {
				t.Fatalf("plan %v, want one bind of the overlay %s", mounts, st.Chain.Merged)
			}
			policy := plan.Policy{Roots: []string{stateDir}}
			if err := policy.Validate(mounts); err != nil {
				t.Fatalf("plan fails policy: %v", err)
			}
			target := filepath.Join(dir, "target")
			exe := node
			if err := exe.Mount(ctx, mounts, plan.Consumer{MountPoint: target}); err != nil {
				t.Fatalf("mount plan: %v", err)
			}
			got, err := os.ReadFile(filepath.Join(target, "hello.txt"))
			if err != nil || string(got) != "from the image\n" {
				t.Errorf("lower file through overlay: %q %v", got, err)
			}
			if err := os.WriteFile(filepath.Join(target, "new.txt"), []byte("written"), 0o644); err != nil {
				t.Errorf("write through overlay: %v", err)
			}
			if _, err := os.Stat(filepath.Join(st.Chain.Upper, "data", "new.txt")); err != nil {
				t.Errorf("write did not land in the upper layer: %v", err)
			}
			if err := exe.Unmount(ctx, mounts, plan.Consumer{MountPoint: target}); err != nil {
				t.Fatalf("unmount plan: %v", err)
			}
			if err := s.Unstage(ctx, v); err != nil {
				t.Fatalf("Unstage: %v", err)
			}
			if _, err := os.Stat(st.Chain.Dir); !os.IsNotExist(err) {
				t.Errorf("chain dir left behind: %v", err)
			}
			if st.Chain.Scratch != nil {
				if _, err := os.Stat(st.Chain.Scratch.Image); !os.IsNotExist(err) {
					t.Errorf("scratch image left behind: %v", err)
				}
			}
			if err := s.Unstage(ctx, v); err != nil {
				t.Fatalf("second Unstage: %v", err)
			}
		})
	}
}

// TestOverlayRefusesWritableImage: an ext4 image is not a valid lower layer.
func TestOverlayRefusesWritableImage(t *testing.T) {
	testutil.RequireRoot(t)
	dir, err := os.MkdirTemp("", "mp-chain-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	testutil.NoLeaks(t, dir)
	img := filepath.Join(dir, "rw.img")
	if _, err := createImage(img, 32<<20, nil); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v %s", err, out)
	}
	s := New(filepath.Join(dir, "state"), newNode(t, filepath.Join(dir, "state"), dir))
	v := source.Volume{ID: "rw", Image: img, Parameters: map[string]string{ParamOverlay: "true"}}
	if _, err := s.Stage(context.Background(), v, source.StageRequest{Record: &sourcetest.Recorder{}}); err == nil {
		t.Fatal("overlay over an ext4 image was accepted")
	}
}

// newNode is the mounter in process, over stateDir, with images allowed
// below imageRoot too (the tests' static images), as the plugin runs one
// without a sidecar.
func newNode(t *testing.T, stateDir, imageRoot string) *mounter.Local {
	t.Helper()
	n, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: stateDir, KubeletDir: imageRoot,
		RecordsDir: filepath.Join(stateDir, "mounter"), Config: &config.Config{ImageRoots: []string{imageRoot}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}
