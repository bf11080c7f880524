package e2e

// A chain: a read-only image (squashfs, erofs) under an admin's image root,
// staged as a static volume with a writable overlay over it. The plugin
// mounts the lower filesystem and the upper (tmpfs, or a scratch image of
// upperSize) under its state dir at stage time, in the host namespace by
// design; the plan is one concrete overlay mount, which the sidecar makes
// inside a container. The overlay itself must never appear on the host.

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/test/testutil"
)

func prepSHA256(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", sha256.Sum256(b))
}

func prepRun(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// prepHostMountAt returns the host's (the test's) mount at p, or nil.
func prepHostMountAt(t *testing.T, p string) *mountinfo.Info {
	t.Helper()
	return prepMountAt(t, os.Getpid(), p)
}

func TestPrepareOverlayChain(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter")
	testutil.NoLeaks(t)
	tm := prepTimer(t)
	ctrd := testutil.StartContainerd(t)
	e := startEnv(t, envOptions{})

	// The images' content.
	content := filepath.Join(e.dir, "content")
	if err := os.MkdirAll(filepath.Join(content, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string]string{"hello.txt": "from the image\n", "sub/deep.txt": "deep\n"} {
		if err := os.WriteFile(filepath.Join(content, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	type chainCase struct{ name, fsType, upperSize, mkfs string }
	cases := []chainCase{
		{name: "squashfs-tmpfs", fsType: "squashfs", mkfs: "mksquashfs"},
		{name: "erofs-scratch", fsType: "erofs", upperSize: "33554432", mkfs: "mkfs.erofs"},
		{name: "squashfs-scratch", fsType: "squashfs", upperSize: "33554432", mkfs: "mksquashfs"},
	}
	c := ctrd.Run(t, "chain", testutil.BusyboxRootfs(t), "sleep", "3600")
	tm.step("containerd, plugin and container running")

	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			testutil.RequireCommands(t, tc.mkfs)
			testutil.NoLeaks(t)
			e := e.with(t)
			tm := &prepTimed{t: t, start: tm.start}
			image := filepath.Join(e.imageRoot, tc.name+"."+tc.fsType)
			if tc.fsType == "squashfs" {
				prepRun(t, "mksquashfs", content, image, "-noappend", "-quiet", "-no-progress")
			} else {
				prepRun(t, "mkfs.erofs", "--quiet", image, content)
			}
			sum := prepSHA256(t, image)

			id := "static-" + tc.name
			vctx := map[string]string{"type": "loop", "image": image, "overlay": "true"}
			if tc.upperSize != "" {
				vctx["upperSize"] = tc.upperSize
			}
			e.stage(id, mountCap("", rwo), vctx)
			st := e.loopState(id)
			dev := e.stagedDevice(id, image)
			if st.Chain == nil || st.FsType != tc.fsType {
				t.Fatalf("journal: chain %+v, fsType %q; want a chain over %s", st.Chain, st.FsType, tc.fsType)
			}
			if ro, _ := os.ReadFile("/sys/block/" + dev.name() + "/ro"); strings.TrimSpace(string(ro)) != "1" {
				t.Errorf("%s under an overlay is attached writable (ro=%q)", dev, ro)
			}
			ch := st.Chain
			wantDir := filepath.Join(e.stateDir(), "chains", id)
			if ch.Dir != wantDir {
				t.Errorf("chain dir %s, want %s", ch.Dir, wantDir)
			}
			// By design the chain's layers are host mounts under the state dir.
			if mi := prepHostMountAt(t, ch.Lower); mi == nil || mi.FSType != tc.fsType || uint32(mi.Major) != dev.Major || uint32(mi.Minor) != dev.Minor {
				t.Errorf("lower layer at %s: %+v, want %s on %s", ch.Lower, mi, tc.fsType, dev)
			}
			upperType := "tmpfs"
			var scratch prepDev
			if tc.upperSize != "" {
				upperType = "ext4"
				if ch.Scratch == nil {
					t.Fatal("journal: no scratch image for upperSize")
				}
				wantImg := filepath.Join(e.stateDir(), "images", "scratch", id+".img")
				if ch.Scratch.Image != wantImg {
					t.Errorf("scratch image %s, want %s", ch.Scratch.Image, wantImg)
				}
				if fi, err := os.Stat(wantImg); err != nil || fmt.Sprint(fi.Size()) != tc.upperSize {
					t.Errorf("scratch image: %v, %v; want %s bytes", fi, err, tc.upperSize)
				}
				scratch = prepDevOf(t, ch.Scratch.Device)
				if got := loopBackingFile(scratch.name()); got != wantImg {
					t.Errorf("scratch device %s backed by %q, want %s", scratch, got, wantImg)
				}
			} else if ch.Scratch != nil {
				t.Errorf("journal: a scratch image %+v without upperSize", ch.Scratch)
			}
			if mi := prepHostMountAt(t, ch.Upper); mi == nil || mi.FSType != upperType {
				t.Errorf("upper layer at %s: %+v, want %s", ch.Upper, mi, upperType)
			}
			// The mounter builds the overlay once, at the chain's merged/
			// under the state dir (as it mounts the layers there); a
			// consumer binds it. The host shows it there and nowhere else.
			if mi := prepHostMountAt(t, ch.Merged); mi == nil || mi.FSType != "overlay" {
				t.Errorf("overlay at %s: %+v, want the chain's overlay", ch.Merged, mi)
			}
			isOverlay := func(mi *mountinfo.Info) bool {
				return mi.FSType == "overlay" && mi.Mountpoint != ch.Merged
			}
			watch := prepWatchHost(t, "an overlay elsewhere than "+ch.Merged, isOverlay)
			tm.step(tc.name + ": staged")

			target := "/" + tc.name
			e.mustSidecarMount(id, c.PID(), target)
			cons := e.wantConsumer(id, c.PID(), target)
			if len(cons.Mounts) != 1 || cons.Mounts[0].Type != "bind" || cons.Mounts[0].Source != ch.Merged {
				t.Errorf("plan %v, want one bind of %s", cons.Mounts, ch.Merged)
			}
			mi := prepMountAt(t, c.PID(), target)
			hostMi := prepHostMountAt(t, ch.Merged)
			if mi == nil || mi.FSType != "overlay" || hostMi == nil || mi.Major != hostMi.Major || mi.Minor != hostMi.Minor {
				t.Fatalf("in the container at %s: %+v, want the chain's overlay %+v", target, mi, hostMi)
			}
			out, err := c.Exec(t, "sh", "-c", fmt.Sprintf("cat %[1]s/hello.txt %[1]s/sub/deep.txt && echo 'written inside' > %[1]s/new.txt && "+
				"echo changed > %[1]s/sub/deep.txt && sync && cat %[1]s/new.txt %[1]s/sub/deep.txt", target))
			if err != nil || out != "from the image\ndeep\nwritten inside\nchanged\n" {
				t.Errorf("inside the container: %q, %v", out, err)
			}
			// Writes land in the upper layer (a host mount by design), never in the image.
			if b, err := os.ReadFile(filepath.Join(ch.Upper, "data", "new.txt")); err != nil || string(b) != "written inside\n" {
				t.Errorf("upper layer's new.txt: %q, %v", b, err)
			}
			if b, err := os.ReadFile(filepath.Join(ch.Lower, "sub", "deep.txt")); err != nil || string(b) != "deep\n" {
				t.Errorf("lower layer's deep.txt: %q, %v", b, err)
			}
			infos, err := mountinfo.GetMounts(nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, mi := range infos {
				if isOverlay(mi) || mi.Mountpoint == target {
					t.Errorf("the host shows the overlay elsewhere than %s: %s %s %s", ch.Merged, mi.Mountpoint, mi.FSType, mi.VFSOptions)
				}
			}
			tm.step(tc.name + ": mounted in the container, read and written")

			// A read-only consumer gets the lower layer alone.
			roTarget := target + "-ro"
			e.mustSidecarMount(id, c.PID(), roTarget, "--readonly")
			if out, err := c.ExecRead(t, "sh", "-c", "cat "+roTarget+"/hello.txt "+roTarget+"/sub/deep.txt; ls "+roTarget); err != nil || out != "from the image\ndeep\nhello.txt\nsub\n" {
				t.Errorf("read-only consumer: %q, %v", out, err)
			}
			if _, err := c.Exec(t, "sh", "-c", "echo x > "+roTarget+"/x"); err == nil {
				t.Error("a read-only consumer could write")
			}
			if n := len(e.consumers(id)); n != 2 {
				t.Errorf("journal: %d consumers, want 2", n)
			}
			e.mustSidecarUnmount(id, c.PID(), roTarget)
			e.mustSidecarUnmount(id, c.PID(), target)
			e.wantNoConsumer(id)
			if mi := prepMountAt(t, c.PID(), target); mi != nil {
				t.Errorf("after unmount the container still has %s at %s", mi.FSType, target)
			}

			e.unstage(id)
			e.noRecord(id)
			for _, p := range []string{ch.Lower, ch.Upper, ch.Merged, ch.Dir} {
				if _, err := os.Lstat(p); !os.IsNotExist(err) {
					t.Errorf("%s left after unstage: %v", p, err)
				}
			}
			if ch.Scratch != nil {
				if _, err := os.Lstat(ch.Scratch.Image); !os.IsNotExist(err) {
					t.Errorf("scratch image %s left after unstage: %v", ch.Scratch.Image, err)
				}
				waitNoLoop(t, ch.Scratch.Image)
			}
			waitNoLoop(t, image)
			if got := prepSHA256(t, image); got != sum {
				t.Errorf("the read-only image changed: sha256 %s, was %s", got, sum)
			}
			watch.check(t, "an overlay elsewhere than "+ch.Merged)
			tm.step(tc.name + ": unmounted and unstaged; chain gone")
		})
	}

	// The consumer of a chain dies without unmounting: its overlay goes
	// with its namespace, and unstage tears the whole chain down (scratch
	// image included) even though the kernel drops the overlay
	// asynchronously.
	t.Run("killed-consumer", func(t *testing.T) {
		testutil.NoLeaks(t)
		e := e.with(t)
		image := filepath.Join(e.imageRoot, "killed.squashfs")
		prepRun(t, "mksquashfs", content, image, "-noappend", "-quiet", "-no-progress")
		id := "static-killed"
		e.stage(id, mountCap("", rwo), map[string]string{"type": "loop", "image": image, "overlay": "true", "upperSize": "33554432"})
		ch := e.loopState(id).Chain
		if ch == nil || ch.Scratch == nil {
			t.Fatalf("journal: chain %+v, want one with a scratch image", ch)
		}
		k := ctrd.Run(t, "killed", testutil.BusyboxRootfs(t), "sleep", "3600")
		e.mustSidecarMount(id, k.PID(), "/data")
		if out, err := k.Exec(t, "sh", "-c", "echo x > /data/x && cat /data/hello.txt"); err != nil || out != "from the image\n" {
			t.Errorf("inside: %q, %v", out, err)
		}
		k.Kill(t)
		e.unstage(id)
		e.noRecord(id)
		for _, p := range []string{ch.Dir, ch.Scratch.Image} {
			if _, err := os.Lstat(p); !os.IsNotExist(err) {
				t.Errorf("%s left after unstage: %v", p, err)
			}
		}
		waitNoLoop(t, ch.Scratch.Image)
		waitNoLoop(t, image)
	})
}
