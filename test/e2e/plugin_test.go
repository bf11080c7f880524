package e2e

// End-to-end tests of the real mountplan-plugin binary over its CSI socket,
// on real loop devices and filesystems (root). Each proves with NoLeaks
// that it left no loop device, mount or process behind.

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// Provisioned volumes: create, stage (attach and format, no mount),
// publish, write, tear down, stage and publish again (the data is still
// there: no second format), tear down and delete.
func TestPluginProvisionedLifecycle(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.xfs")
	root := startEnv(t, envOptions{})

	for _, tc := range []struct {
		fsType string
		size   int64
	}{{"ext4", 64 * miB}, {"xfs", 300 * miB}} {
		t.Run(tc.fsType, func(t *testing.T) {
			e := root.with(t)
			id := "vol-" + tc.fsType
			vol := e.create(id, tc.fsType, tc.size)
			img := e.image(id)
			c := mountCap(tc.fsType, rwo)

			e.stage(id, c, vol.GetVolumeContext())
			l := e.checkStagedLoop(id, img)
			e.notMounted(l)
			if isMountPoint(t, e.staging(id)) {
				t.Errorf("staging path %s is a mount point; stage must not mount", e.staging(id))
			}
			if f := e.mustRecord(id).Format; f == nil || !f.Done || f.FsType != tc.fsType {
				t.Errorf("record format after stage: %+v, want %s done", f, tc.fsType)
			}
			// Staging again is a no-op on the same device.
			e.stage(id, c, vol.GetVolumeContext())
			if again := e.checkStagedLoop(id, img); again != l {
				t.Errorf("repeated stage: device %+v, was %+v", again, l)
			}
			_, err := e.ctl.DeleteVolume(rpcCtx(t), &csi.DeleteVolumeRequest{VolumeId: id})
			testutil.WantCode(t, "DeleteVolume while staged", err, codes.FailedPrecondition)

			target := e.target(id, "mnt")
			e.publish(id, target, c, false, nil)
			if m := plugMountsOf(t, os.Getpid(), l.Dev); len(m) != 1 || m[0] != target {
				t.Errorf("%s mounted at %v, want only at %s", l.Path(), m, target)
			}
			if opts := plugMountOptions(t, target); !plugHasOpts(opts, "rw", "nosuid", "nodev") {
				t.Errorf("publish mount options %q, want rw,nosuid,nodev", opts)
			}
			const data = "written through the published target\n"
			plugWriteFile(t, filepath.Join(target, "hello"), data)

			e.unpublish(id, target)
			e.notMounted(l)
			e.unstage(id)
			waitNoLoop(t, img)
			if v := e.mustRecord(id); v.Stage != nil {
				t.Errorf("record still has a stage after unstage: %+v", v.Stage)
			}

			e.stage(id, c, vol.GetVolumeContext())
			l = e.checkStagedLoop(id, img)
			e.notMounted(l)
			e.publish(id, target, c, false, nil)
			if got := plugReadFile(t, filepath.Join(target, "hello")); got != data {
				t.Errorf("after a second stage the file holds %q, want %q (was the image formatted again?)", got, data)
			}
			e.unpublish(id, target)
			e.unstage(id)
			waitNoLoop(t, img)
			e.delete(id)
		})
	}
}

func plugHasOpts(opts string, want ...string) bool {
	have := strings.Split(opts, ",")
	for _, w := range want {
		found := false
		for _, h := range have {
			found = found || h == w
		}
		if !found {
			return false
		}
	}
	return true
}

// Block access: the target is a bind of the loop device node; what is
// written through it lands in the image.
func TestPluginBlock(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "vol-block"
	// Provisioned for block access: the image stays blank (a volume asked
	// for with mount access only gets its filesystem at create).
	e.createFor(id, 32*miB, blockCap(rwo))
	img := e.image(id)

	e.stage(id, blockCap(rwo), nil)
	l := e.checkStagedLoop(id, img)
	e.notMounted(l)
	if f := e.mustRecord(id).Format; f != nil {
		t.Errorf("a block stage recorded a format: %+v", f)
	}

	target := e.target(id, "dev")
	e.publish(id, target, blockCap(rwo), false, nil)
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Errorf("target %s has mode %o, want a block device", target, st.Mode)
	}
	if got := plugDevString(st.Rdev); got != l.Dev {
		t.Errorf("target rdev %s, loop device %s is %s", got, l.Path(), l.Dev)
	}
	if !isMountPoint(t, target) {
		t.Errorf("target %s is not a mount point (a bind of the device node)", target)
	}

	const off = 5*miB + 8192
	want := make([]byte, 4096)
	if _, err := rand.Read(want); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(target, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(want, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	got := make([]byte, len(want))
	imgf, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := imgf.ReadAt(got, off); err != nil {
		t.Fatal(err)
	}
	imgf.Close()
	if !bytes.Equal(got, want) {
		t.Errorf("4 KiB written at %d through %s do not read back from the image", off, target)
	}

	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)
	e.delete(id)
}

func plugDevString(rdev uint64) string {
	return fmt.Sprintf("%d:%d", unix.Major(rdev), unix.Minor(rdev))
}

// Static volumes: an admin's image under an allowed root is staged without
// being formatted; anything that names or resolves to a path outside the
// roots is refused, and nothing is left behind.
func TestPluginStaticImage(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	e := startEnv(t, envOptions{})

	img := filepath.Join(e.imageRoot, "static.img")
	plugMkfsExt4Image(t, img, 32*miB, map[string]string{"hello.txt": "static content\n"})
	outside := filepath.Join(e.dir, "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	outImg := filepath.Join(outside, "out.img")
	plugMkfsExt4Image(t, outImg, 32*miB, nil)
	for link, to := range map[string]string{"link.img": outImg, "linkdir": outside} {
		if err := os.Symlink(to, filepath.Join(e.imageRoot, link)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(e.imageRoot, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}

	t.Run("inside the root", func(t *testing.T) {
		e := e.with(t)
		const id = "static-ok"
		vctx := map[string]string{"type": "loop", "image": img}
		e.stage(id, mountCap("", rwo), vctx)
		l := e.checkStagedLoop(id, img)
		e.notMounted(l)
		if v := e.mustRecord(id); v.Kind != model.KindStatic || v.Image != img {
			t.Errorf("record: kind %s image %s", v.Kind, v.Image)
		}
		target := e.target(id, "mnt")
		e.publish(id, target, mountCap("", rwo), false, vctx)
		if got := plugReadFile(t, filepath.Join(target, "hello.txt")); got != "static content\n" {
			t.Errorf("hello.txt holds %q: the admin's image was not used as it is", got)
		}
		e.unpublish(id, target)
		e.unstage(id)
		waitNoLoop(t, img)
		e.noRecord(id)
		if _, err := os.Stat(img); err != nil {
			t.Errorf("the admin's image is gone after unstage: %v", err)
		}
	})

	for i, tc := range []struct {
		name string
		vctx map[string]string
		code codes.Code
	}{
		{"outside the roots", map[string]string{"type": "loop", "image": outImg}, codes.InvalidArgument},
		{"symlink inside the root to a file outside", map[string]string{"type": "loop", "image": filepath.Join(e.imageRoot, "link.img")}, codes.InvalidArgument},
		{"symlinked directory inside the root", map[string]string{"type": "loop", "image": filepath.Join(e.imageRoot, "linkdir", "out.img")}, codes.InvalidArgument},
		{"dot-dot out of the root", map[string]string{"type": "loop", "image": e.imageRoot + "/../outside/out.img"}, codes.InvalidArgument},
		{"dot-dot staying inside the root", map[string]string{"type": "loop", "image": e.imageRoot + "/sub/../static.img"}, codes.InvalidArgument},
		{"relative path", map[string]string{"type": "loop", "image": "images/static.img"}, codes.InvalidArgument},
		{"a directory", map[string]string{"type": "loop", "image": filepath.Join(e.imageRoot, "sub")}, codes.InvalidArgument},
		{"the root itself", map[string]string{"type": "loop", "image": e.imageRoot}, codes.InvalidArgument},
		{"unknown type", map[string]string{"type": "nbd", "image": img}, codes.InvalidArgument},
		{"unknown attribute", map[string]string{"type": "loop", "image": img, "hostPath": "/"}, codes.InvalidArgument},
		{"missing image", map[string]string{"type": "loop", "image": filepath.Join(e.imageRoot, "missing.img")}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := e.with(t)
			id := "static-bad-" + strconv.Itoa(i)
			err := e.tryStage(id, mountCap("", rwo), tc.vctx, nil)
			testutil.WantCode(t, "NodeStageVolume", err, tc.code)
			if ids := e.records(); len(ids) != 0 {
				t.Errorf("records left under %s/volumes: %v", e.stateDir(), ids)
			}
			for _, f := range []string{img, outImg} {
				if ls := plugLoopsBackedBy(t, f); len(ls) != 0 {
					t.Errorf("loop devices attached to %s: %+v", f, ls)
				}
			}
		})
	}
}

// A reader-only stage attaches the loop device read-only; the published
// filesystem refuses writes with EROFS.
func TestPluginReadOnly(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "vol-ro"
	e.create(id, "ext4", 32*miB)
	img := e.image(id)
	target := e.target(id, "mnt")

	// Format it and leave a file, read-write first.
	e.stage(id, mountCap("ext4", rwo), nil)
	e.publish(id, target, mountCap("ext4", rwo), false, nil)
	plugWriteFile(t, filepath.Join(target, "f"), "before\n")
	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)

	ro := mountCap("ext4", roo)
	e.stage(id, ro, nil)
	l := e.checkStagedLoop(id, img)
	if v, _ := plugSysfs(l.Name, "ro"); v != "1" {
		t.Errorf("%s: sysfs ro=%q, want 1", l.Path(), v)
	}
	if !e.loopState(id).ReadOnly {
		t.Error("record does not say the device is read-only")
	}
	e.publish(id, target, ro, true, nil)
	if opts := plugMountOptions(t, target); !plugHasOpts(opts, "ro") {
		t.Errorf("mount options %q, want ro", opts)
	}
	if got := plugReadFile(t, filepath.Join(target, "f")); got != "before\n" {
		t.Errorf("read %q", got)
	}
	for _, p := range []string{filepath.Join(target, "new"), filepath.Join(target, "f")} {
		err := os.WriteFile(p, []byte("x"), 0o644)
		if !errors.Is(err, syscall.EROFS) {
			t.Errorf("writing %s on a read-only publish: %v, want EROFS", p, err)
		}
	}
	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, img)
	e.delete(id)
}

// Inline ephemeral volumes are made at publish and removed at unpublish.
func TestPluginEphemeral(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "csi-e2e-inline"
	img := loop.ImagePath(e.stateDir(), model.KindEphemeral, id)
	target := e.target(id, "mnt")
	vctx := map[string]string{ctxEphemeral: "true", "size": "64Mi", "csi.storage.k8s.io/pod.name": "p"}

	for _, bad := range []map[string]string{
		{ctxEphemeral: "true", "size": "lots"},
		{ctxEphemeral: "true", "image": "/etc/passwd"},
	} {
		_, err := e.node.NodePublishVolume(rpcCtx(t), &csi.NodePublishVolumeRequest{
			VolumeId: id, TargetPath: target, VolumeCapability: mountCap("", rwo), VolumeContext: bad})
		testutil.WantCode(t, "inline publish with context "+strings.Join(plugKeys(bad), ","), err, codes.InvalidArgument)
		e.noRecord(id)
		if _, err := os.Stat(img); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("failed inline publish left its image: %v", err)
		}
	}

	e.publish(id, target, mountCap("", rwo), false, vctx)
	if !isMountPoint(t, target) {
		t.Fatalf("%s not mounted", target)
	}
	plugWriteFile(t, filepath.Join(target, "f"), "inline\n")
	if got := plugReadFile(t, filepath.Join(target, "f")); got != "inline\n" {
		t.Errorf("read back %q", got)
	}
	if v := e.mustRecord(id); v.Kind != model.KindEphemeral {
		t.Errorf("record kind %s", v.Kind)
	}
	if fi, err := os.Stat(img); err != nil || fi.Size() != 64*miB {
		t.Errorf("inline image: %v, %v; want 64 MiB", fi, err)
	}
	l := e.checkStagedLoop(id, img)
	if m := plugMountsOf(t, os.Getpid(), l.Dev); len(m) != 1 || m[0] != target {
		t.Errorf("%s mounted at %v, want only %s", l.Path(), m, target)
	}
	// Publishing again is idempotent.
	e.publish(id, target, mountCap("", rwo), false, vctx)

	e.unpublish(id, target)
	waitNoLoop(t, img)
	e.noRecord(id)
	if _, err := os.Stat(img); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("inline image left after unpublish: %v", err)
	}
}

func plugKeys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// NodeGetVolumeStats on a published volume; NodeExpandVolume after
// ControllerExpandVolume grows the mounted filesystem.
func TestPluginStatsAndExpand(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "mkfs.xfs", "xfs_growfs", "resize2fs")
	root := startEnv(t, envOptions{})

	t.Run("stats", func(t *testing.T) {
		e := root.with(t)
		const id = "vol-stats"
		e.create(id, "ext4", 32*miB)
		e.stage(id, mountCap("ext4", rwo), nil)
		target := e.target(id, "mnt")
		e.publish(id, target, mountCap("ext4", rwo), false, nil)
		r, err := e.node.NodeGetVolumeStats(rpcCtx(t), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target, StagingTargetPath: e.staging(id)})
		if err != nil {
			t.Fatal(err)
		}
		units := map[csi.VolumeUsage_Unit]*csi.VolumeUsage{}
		for _, u := range r.GetUsage() {
			units[u.GetUnit()] = u
		}
		for _, unit := range []csi.VolumeUsage_Unit{csi.VolumeUsage_BYTES, csi.VolumeUsage_INODES} {
			u := units[unit]
			if u.GetTotal() <= 0 || u.GetAvailable() <= 0 || u.GetAvailable() > u.GetTotal() || u.GetUsed() < 0 {
				t.Errorf("%s usage %+v", unit, u)
			}
		}
		if b := units[csi.VolumeUsage_BYTES].GetTotal(); b > 32*miB {
			t.Errorf("bytes total %d > volume size", b)
		}
		for _, tc := range []struct{ name, id, path string }{
			{"a path holding no volume", id, e.dir},
			{"a path that does not exist", id, filepath.Join(e.dir, "nothing")},
			{"an unknown volume", "vol-unknown", target},
		} {
			_, err := e.node.NodeGetVolumeStats(rpcCtx(t), &csi.NodeGetVolumeStatsRequest{VolumeId: tc.id, VolumePath: tc.path})
			testutil.WantCode(t, "NodeGetVolumeStats on "+tc.name, err, codes.NotFound)
		}
		e.unpublish(id, target)
		e.unstage(id)
		waitNoLoop(t, e.image(id))
		e.delete(id)
	})

	for _, tc := range []struct {
		fsType       string
		size, grow   int64
		needsSysRsrc bool
	}{{"xfs", 300 * miB, 400 * miB, false}, {"ext4", 32 * miB, 64 * miB, true}} {
		t.Run("expand "+tc.fsType, func(t *testing.T) {
			e := root.with(t)
			id := "vol-grow-" + tc.fsType
			e.create(id, tc.fsType, tc.size)
			c := mountCap(tc.fsType, rwo)
			e.stage(id, c, nil)
			l := e.checkStagedLoop(id, e.image(id))
			target := e.target(id, "mnt")
			e.publish(id, target, c, false, nil)
			plugWriteFile(t, filepath.Join(target, "f"), "kept\n")
			before := plugStatfsTotal(t, target)

			cr, err := e.ctl.ControllerExpandVolume(rpcCtx(t), &csi.ControllerExpandVolumeRequest{
				VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: tc.grow}, VolumeCapability: c})
			if err != nil {
				t.Fatal(err)
			}
			if cr.GetCapacityBytes() < tc.grow || !cr.GetNodeExpansionRequired() {
				t.Errorf("ControllerExpandVolume: %+v", cr)
			}
			nr, err := e.node.NodeExpandVolume(rpcCtx(t), &csi.NodeExpandVolumeRequest{
				VolumeId: id, VolumePath: target, StagingTargetPath: e.staging(id),
				CapacityRange: &csi.CapacityRange{RequiredBytes: tc.grow}, VolumeCapability: c})
			if tc.needsSysRsrc && !plugCapEff(t, e.plugin.PID(), unix.CAP_SYS_RESOURCE) {
				testutil.WantCode(t, "NodeExpandVolume of a mounted ext4 without CAP_SYS_RESOURCE", err, codes.FailedPrecondition)
				if !strings.Contains(status.Convert(err).Message(), "CAP_SYS_RESOURCE") {
					t.Errorf("message %q does not name CAP_SYS_RESOURCE", status.Convert(err).Message())
				}
			} else {
				if err != nil {
					t.Fatalf("NodeExpandVolume: %v", err)
				}
				if nr.GetCapacityBytes() < tc.grow {
					t.Errorf("NodeExpandVolume capacity %d < %d", nr.GetCapacityBytes(), tc.grow)
				}
				if after := plugStatfsTotal(t, target); after <= before {
					t.Errorf("filesystem size %d after expand, was %d", after, before)
				}
			}
			if sectors, _ := plugSysfs(l.Name, "size"); sectors != strconv.Itoa(int(tc.grow/512)) {
				t.Errorf("%s: %s sectors, want %d", l.Path(), sectors, tc.grow/512)
			}
			if got := plugReadFile(t, filepath.Join(target, "f")); got != "kept\n" {
				t.Errorf("file after expand: %q", got)
			}
			e.unpublish(id, target)
			e.unstage(id)
			waitNoLoop(t, e.image(id))
			e.delete(id)
		})
	}
}

// Secrets reach the plugin but never its log (requests are logged at
// --v=4 and above with protosanitizer) or its journal.
func TestPluginSecretsNotLogged(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{args: []string{"--v=5"}})
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	canary := "mpcanary" + hex.EncodeToString(b)
	secrets := map[string]string{"password": canary, "chap-secret": canary + "-2"}

	const id = "vol-secret"
	if _, err := e.ctl.CreateVolume(rpcCtx(t), &csi.CreateVolumeRequest{
		Name: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * miB},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)}, Secrets: secrets,
	}); err != nil {
		t.Fatal(err)
	}
	if err := e.tryStage(id, mountCap("ext4", rwo), nil, secrets); err != nil {
		t.Fatal(err)
	}
	// A failing request is logged with its error: no secret there either.
	err := e.tryStage("vol-secret-missing", mountCap("ext4", rwo), map[string]string{"type": "loop", "image": "/nonexistent/missing.img"}, secrets)
	if status.Code(err) == codes.OK {
		t.Error("staging a missing static image succeeded")
	}
	target := e.target(id, "mnt")
	if _, err := e.node.NodePublishVolume(rpcCtx(t), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), TargetPath: target,
		VolumeCapability: mountCap("ext4", rwo), Secrets: secrets,
	}); err != nil {
		t.Fatal(err)
	}
	e.unpublish(id, target)
	e.unstage(id)
	e.delete(id)

	log := e.plugin.Log()
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, canary) {
			t.Errorf("secret in the plugin log: %s", line)
		}
	}
	if !strings.Contains(log, "***stripped***") {
		t.Errorf("the log shows no sanitised request (***stripped***): were requests logged at --v=5?\n%s", log)
	}
	err = filepath.WalkDir(e.stateDir(), func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || strings.HasSuffix(p, ".img") {
			return err
		}
		if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(canary)) {
			t.Errorf("secret written to %s", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// SIGTERM: the plugin exits 0, kubelet's publishes stay mounted, and a new
// plugin takes over, over a stale socket too.
func TestPluginSIGTERM(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	e := startEnv(t, envOptions{})
	const id = "vol-term"
	e.create(id, "ext4", 32*miB)
	e.stage(id, mountCap("ext4", rwo), nil)
	l := e.checkStagedLoop(id, e.image(id))
	target := e.target(id, "mnt")
	e.publish(id, target, mountCap("ext4", rwo), false, nil)

	if err := e.plugin.Stop(); err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
	if e.plugin.Running() {
		t.Fatal("plugin still running after Stop")
	}
	if m := plugMountsOf(t, os.Getpid(), l.Dev); len(m) != 1 || m[0] != target {
		t.Errorf("after SIGTERM the publish is mounted at %v, want %s", m, target)
	}
	if _, err := os.Stat(e.plugin.Socket); err == nil {
		t.Logf("socket %s left after a clean stop", e.plugin.Socket)
	}
	e.restart()
	plugWriteFile(t, filepath.Join(target, "f"), "after restart\n")
	e.unpublish(id, target)
	e.unstage(id)
	waitNoLoop(t, e.image(id))

	// A stale socket from a killed plugin does not stop the next one.
	e.plugin.Kill9()
	if fi, err := os.Lstat(e.plugin.Socket); err != nil || fi.Mode().Type() != fs.ModeSocket {
		t.Fatalf("no stale socket after kill -9: %v", err)
	}
	e.restart()
	if _, err := e.node.NodeGetInfo(rpcCtx(t), &csi.NodeGetInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	e.delete(id)
	if err := e.plugin.Stop(); err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
}
