package nri_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestNRIVolumeInContainers: a loop ext4 volume in NRI mode reaches two
// containers of a pod and a container of a second pod as an ext4 mount
// of the loop device inside each container's namespace, made by the
// runtime; data persists between them; each container is a consumer while
// it exists; a read-only mount is read-only; kubelet's target holds only
// the guard, and after the pods are gone the volume unstages.
func TestNRIVolumeInContainers(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, vctx := e.createVolume("nri-ext4", mountCap())
	e.stage(id, mountCap(), vctx)
	dev := e.record(id).Stage.Source // for the message only

	podA := e.cri.RunPod(t, "a")
	targetA := e.target(podA.UID, "pv-ext4", false)
	e.mustPublish(id, targetA, mountCap(), vctx, publishOptions{})
	e.mustPublish(id, targetA, mountCap(), vctx, publishOptions{}) // idempotent

	c1 := podA.RunContainer(t, "c1", volumeMount("/data", targetA, false))
	fsType, src := e.fsAt(c1, "/data")
	if fsType != "ext4" || !strings.HasPrefix(src, "/dev/loop") {
		t.Fatalf("container c1: /data is %s from %s, want ext4 from the volume's loop device (%s)", fsType, src, dev)
	}
	e.exec(c1, "echo from-c1 > /data/f && sync")
	e.wantConsumers(id, c1)

	c2 := podA.RunContainer(t, "c2", volumeMount("/data", targetA, false))
	if got := e.exec(c2, "cat /data/f"); got != "from-c1\n" {
		t.Errorf("second container reads %q, want from-c1", got)
	}
	e.wantConsumers(id, c1, c2)
	ro := podA.RunContainer(t, "ro", volumeMount("/data", targetA, true))
	if got := e.exec(ro, "grep ' /data ' /proc/self/mountinfo"); !strings.Contains(strings.Fields(got)[5], "ro") {
		t.Errorf("read-only container mount: %s", got)
	}
	if _, err := e.cri.Exec(ro, "touch", "/data/nope"); err == nil {
		t.Error("a read-only container could write to the volume")
	}
	e.removeContainer(c1)
	e.removeContainer(ro)
	e.wantConsumers(id, c2)

	podB := e.cri.RunPod(t, "b")
	targetB := e.target(podB.UID, "pv-ext4", false)
	e.mustPublish(id, targetB, mountCap(), vctx, publishOptions{})
	c3 := podB.RunContainer(t, "c3", volumeMount("/data", targetB, false))
	if got := e.exec(c3, "cat /data/f"); got != "from-c1\n" {
		t.Errorf("container of a second pod reads %q, want from-c1", got)
	}
	e.wantConsumers(id, c2, c3)
	if err := e.unstage(id); err == nil {
		t.Error("NodeUnstageVolume succeeded while containers use the volume")
	}

	e.finish(id, []*testutil.Pod{podA, podB}, targetA, targetB)
	if e.poller.count() < 100 {
		t.Errorf("the host's mount table was sampled only %d times", e.poller.count())
	}
}

// guardAt reports whether target holds the guard in the host's mount
// table.
func guardAt(t *testing.T, target string) bool {
	t.Helper()
	infos, err := testutil.MountInfoOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range infos {
		if i.Mountpoint == target && i.FSType == guard.FSType {
			return true
		}
	}
	return false
}

// TestNRIHookAbsent proves the safeguard: with no hook registered a volume
// in NRI mode cannot be published; once published, a container created
// while the hook is down (its mounter stopped, killed, or not registered)
// fails to be created, with the runtime saying why, instead of starting
// with an empty directory of the node's disk at the volume's path; with
// the hook back, the same container config starts with its volume.
func TestNRIHookAbsent(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, vctx := e.createVolume("nri-absent", mountCap())
	e.stage(id, mountCap(), vctx)
	pod := e.cri.RunPod(t, "p")
	target := e.target(pod.UID, "pv", false)

	e.sidecar.stop(syscall.SIGTERM)
	err := e.publish(id, target, mountCap(), vctx, publishOptions{})
	// The hook is the mounter's: with it gone, the mounter is too, and the
	// plugin, which looks at kubelet's directory through the mounter, says
	// so first.
	testutil.WantCode(t, "NodePublishVolume without a hook", err, codes.Unavailable, "mounter")
	if guardAt(t, target) {
		t.Fatal("a failed publish left a guard")
	}

	e.sidecar.start()
	e.waitHook()
	e.mustPublish(id, target, mountCap(), vctx, publishOptions{})
	if !guardAt(t, target) {
		t.Fatal("the publish left no guard at the target")
	}

	// The hook goes away (a clean stop; kill -9 is TestNRIMounterKilled's).
	e.sidecar.stop(syscall.SIGTERM)
	ctr, err := pod.CreateContainer("without-hook", volumeMount("/data", target, false))
	if err == nil {
		err = e.cri.StartContainer(ctr)
	}
	if err == nil {
		fsType, _ := e.fsAt(ctr, "/data")
		t.Fatalf("a container started without the hook; /data in it is %q", fsType)
	}
	if !strings.Contains(err.Error(), "transport endpoint is not connected") {
		t.Errorf("the runtime's error does not say the target is unusable: %v", err)
	}
	t.Logf("without the hook the runtime refuses the container: %v", err)

	e.sidecar.start()
	e.waitHook()
	ctr = pod.RunContainer(t, "with-hook", volumeMount("/data", target, false))
	if fsType, _ := e.fsAt(ctr, "/data"); fsType != "ext4" {
		t.Fatalf("with the hook back, /data is %q, want ext4", fsType)
	}
	e.removeContainer(ctr)
	e.finish(id, []*testutil.Pod{pod}, target)
}

// TestNRIPluginWithoutNRI: a volume that asks for NRI mode on a node whose
// plugin does not offer it is refused, never published the classic way.
func TestNRIPluginWithoutNRI(t *testing.T) {
	e := newEnv(t, envOptions{noNRIPlugin: true})
	id, vctx := e.createVolume("nri-off", mountCap())
	e.stage(id, mountCap(), vctx)
	target := e.target("uid-x", "pv", false)
	err := e.publish(id, target, mountCap(), vctx, publishOptions{})
	testutil.WantCode(t, "NodePublishVolume in NRI mode with a plugin without --nri", err, codes.FailedPrecondition, "--nri")
	if err := e.unstage(id); err != nil {
		t.Fatal(err)
	}
	e.deleteVolume(id)
}

// TestNRIMounterKilled kills the sidecar (the hook and the guard's server)
// with SIGKILL while a pod runs and while containers are being created: the
// running container keeps its volume; a container created meanwhile either
// has its volume or fails with the runtime's error; after a restart the
// plugin's consumers are the containers the runtime runs (the claim of a
// container removed meanwhile is released), and new containers work.
func TestNRIMounterKilled(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, pod, target := e.podWithVolume("nri-kill", mountCap(), publishOptions{})
	keep := pod.RunContainer(t, "keep", volumeMount("/data", target, false))
	gone := pod.RunContainer(t, "gone", volumeMount("/data", target, false))
	e.exec(keep, "echo before > /data/f")
	e.wantConsumers(id, keep, gone)

	e.sidecar.stop(syscall.SIGKILL)
	if got := e.exec(keep, "cat /data/f && echo after > /data/g && cat /data/g"); got != "before\nafter\n" {
		t.Errorf("the running container lost its volume when the mounter died: %q", got)
	}
	e.removeContainer(gone) // the dead hook hears nothing of it
	if _, err := pod.CreateContainer("while-dead", volumeMount("/data", target, false)); err == nil ||
		!strings.Contains(err.Error(), "transport endpoint is not connected") {
		t.Errorf("creating a container while the mounter is dead: %v, want the runtime's ENOTCONN", err)
	}

	// Killed in the middle of creations: stopped first (the runtime then
	// waits on the guard or on the hook), or at a random moment.
	var started []string
	rounds := []struct {
		stopFirst bool
		delay     time.Duration
	}{{true, 300 * time.Millisecond}, {false, 0}, {false, 5 * time.Millisecond}, {false, 20 * time.Millisecond}, {false, 60 * time.Millisecond}}
	for round, r := range rounds {
		e.sidecar.start()
		e.waitHook()
		if r.stopFirst {
			e.sidecar.signal(syscall.SIGSTOP)
		}
		result := make(chan error, 1)
		var ctr string
		go func() {
			var err error
			if ctr, err = pod.CreateContainer(fmt.Sprintf("race-%d", round), volumeMount("/data", target, false)); err == nil {
				err = e.cri.StartContainer(ctr)
			}
			result <- err
		}()
		time.Sleep(r.delay)
		e.sidecar.stop(syscall.SIGKILL)
		if err := <-result; err != nil {
			msg := err.Error()
			t.Logf("round %d (stopped first %t, killed after %v): the container was refused: ...%s", round, r.stopFirst, r.delay, msg[max(0, len(msg)-160):])
			if ctr != "" {
				_ = e.cri.RemoveContainer(ctr)
			}
			continue
		}
		if fsType, _ := e.fsAt(ctr, "/data"); fsType != "ext4" {
			t.Fatalf("round %d: a container created while the mounter was killed runs with /data of type %q", round, fsType)
		}
		t.Logf("round %d (stopped first %t, killed after %v): the container got its volume", round, r.stopFirst, r.delay)
		started = append(started, ctr)
	}

	e.sidecar.start()
	e.waitHook()
	e.wantConsumers(id, append(started, keep)...)
	again := pod.RunContainer(t, "again", volumeMount("/data", target, false))
	if got := e.exec(again, "cat /data/g"); got != "after\n" {
		t.Errorf("a container after the restart reads %q", got)
	}
	e.wantConsumers(id, append(started, keep, again)...)
	e.finish(id, []*testutil.Pod{pod}, target)
}

// TestNRIBlock: a block volume in NRI mode is published as a device node
// (no mount, no bind of the device in the host), and the container gets
// the volume's device from the runtime, as a device adjustment of the
// hook, which also records the container as a consumer.
func TestNRIBlock(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, pod, target := e.podWithVolume("nri-block", blockCap(), publishOptions{})
	var st unix.Stat_t
	if err := unix.Lstat(target, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("the block publish left %v (mode %o), want a block device node", err, st.Mode)
	}
	if mounted, err := mountinfo.Mounted(target); err != nil || mounted {
		t.Fatalf("the block publish mounted something at %s (%v)", target, err)
	}
	spec := testutil.ContainerSpec{Devices: []testutil.CRIDevice{{ContainerPath: "/dev/xvda", HostPath: target, Permissions: "rwm"}}}
	c1 := pod.RunContainer(t, "c1", spec)
	e.exec(c1, "test -b /dev/xvda && echo block-data | dd of=/dev/xvda bs=512 conv=sync,notrunc 2>/dev/null && sync")
	e.wantConsumers(id, c1)
	c2 := pod.RunContainer(t, "c2", spec)
	if got := e.exec(c2, "dd if=/dev/xvda bs=512 count=1 2>/dev/null | head -c 10"); got != "block-data" {
		t.Errorf("a second container reads %q from the device", got)
	}
	e.wantConsumers(id, c1, c2)
	e.finish(id, []*testutil.Pod{pod}, target)
	if err := unix.Lstat(target, &st); !errors.Is(err, unix.ENOENT) {
		t.Errorf("the device node is still at %s after unpublish: %v", target, err)
	}
}

// TestNRIChainAndFUSE: an overlay chain over a squashfs image and a FUSE
// volume (squashfuse) in NRI mode reach containers as an overlay mount and
// a bind of the daemon's mount, made by the runtime inside the container;
// their host-side sources live under the state dir, never at a kubelet
// path, and measure the volume once no container runs.
func TestNRIChainAndFUSE(t *testing.T) {
	testutil.RequireCommands(t, "mksquashfs", "mkfs.erofs", "squashfuse")
	dir := t.TempDir()
	images := filepath.Join(dir, "images")
	content := filepath.Join(dir, "content")
	for _, d := range []string{images, content} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("from the image\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	image, erofs := filepath.Join(images, "tools.sqfs"), filepath.Join(images, "tools.erofs")
	for _, cmd := range [][]string{{"mksquashfs", content, image, "-noappend", "-quiet", "-no-progress"}, {"mkfs.erofs", "--quiet", erofs, content}} {
		if out, err := exec.Command(cmd[0], cmd[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", cmd[0], err, out)
		}
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`defaultFsType: ext4
imageRoots: [%q]
fuseProfiles:
- name: squashfuse
  binary: /usr/bin/squashfuse
  args: [-f, "{source}", "{mountpoint}", -o, allow_other]
  source: {roots: [%q]}
  readyTimeout: 10s
`, images, images)), 0o644); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, envOptions{config: cfg})
	pod := e.cri.RunPod(t, "p")
	cases := []struct {
		id, fsType string
		vctx       map[string]string
		writable   bool
	}{
		{"chain", "overlay", map[string]string{"type": "loop", "image": image, "overlay": "true", "nri": "true"}, true},
		{"chain-erofs", "overlay", map[string]string{"type": "loop", "image": erofs, "overlay": "true", "upperSize": "33554432", "nri": "true"}, true},
		{"fuse", "fuse.squashfuse", map[string]string{"type": "fuse", "profile": "squashfuse", "source": image, "nri": "true"}, false},
	}
	for _, tc := range cases {
		t.Run(tc.id, func(t *testing.T) {
			e.stage(tc.id, mountCap(), tc.vctx)
			target := e.target(pod.UID, tc.id, false)
			e.mustPublish(tc.id, target, mountCap(), tc.vctx, publishOptions{})
			c1 := pod.RunContainer(t, tc.id+"-1", volumeMount("/data", target, false))
			if fsType, _ := e.fsAt(c1, "/data"); fsType != tc.fsType {
				t.Errorf("/data in the container is %q, want %s", fsType, tc.fsType)
			}
			if got := e.exec(c1, "cat /data/hello.txt"); got != "from the image\n" {
				t.Errorf("reading the image's file: %q", got)
			}
			if tc.writable {
				e.exec(c1, "echo upper > /data/new.txt")
			}
			e.wantConsumers(tc.id, c1)
			e.removeContainer(c1)
			c2 := pod.RunContainer(t, tc.id+"-2", volumeMount("/data", target, false))
			if tc.writable {
				if got := e.exec(c2, "cat /data/new.txt"); got != "upper\n" {
					t.Errorf("the next container reads %q from the chain's upper layer", got)
				}
			}
			e.wantConsumers(tc.id, c2)
			running := e.usedBytes(tc.id, target)
			e.removeContainer(c2)
			e.wantConsumers(tc.id)
			// With no container left, the stats come from the chain's
			// overlay or the daemon's mount under the state dir: the same
			// filesystem the container had.
			if stopped := e.usedBytes(tc.id, target); running <= 0 || stopped != running {
				t.Errorf("used bytes with no container running: %d, with one: %d", stopped, running)
			}
			e.unpublish(tc.id, target)
			if err := e.unstage(tc.id); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestNRIFSGroup: with VOLUME_MOUNT_GROUP kubelet hands the pod's fsGroup
// to the driver, which gives the volume to that group (kubelet would only
// have reached the guard); a non-root container of the group writes.
func TestNRIFSGroup(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, pod, target := e.podWithVolume("nri-fsgroup", mountCap(), publishOptions{mountGroup: "2000"})
	spec := volumeMount("/data", target, false)
	spec.RunAsUser, spec.SupplementalGroups = 1000, []int64{2000}
	c := pod.RunContainer(t, "app", spec)
	if got := e.exec(c, "id -u; stat -c '%g %A' /data; echo hi > /data/by-1000 && stat -c %g /data/by-1000"); got != "1000\n2000 drwxrwsr-x\n2000\n" {
		t.Errorf("a non-root container of the fsGroup: %q, want uid 1000, /data group 2000 setgid, and a file it wrote of group 2000", got)
	}
	e.finish(id, []*testutil.Pod{pod}, target)
}

// TestNRIXFS: an xfs volume in NRI mode, mounted by the runtime inside the
// container.
func TestNRIXFS(t *testing.T) {
	testutil.RequireCommands(t, "mkfs.xfs")
	e := newEnv(t, envOptions{})
	id, vctx := e.createVolumeOf("nri-xfs", mountCap(), 300<<20, map[string]string{"fsType": "xfs"})
	e.stage(id, mountCap(), vctx)
	pod := e.cri.RunPod(t, "p")
	target := e.target(pod.UID, "pv", false)
	e.mustPublish(id, target, mountCap(), vctx, publishOptions{})
	c := pod.RunContainer(t, "c", volumeMount("/data", target, false))
	if fsType, src := e.fsAt(c, "/data"); fsType != "xfs" || !strings.HasPrefix(src, "/dev/loop") {
		t.Errorf("/data in the container is %s from %s, want xfs from the volume's loop device", fsType, src)
	}
	e.exec(c, "echo x > /data/f")
	e.finish(id, []*testutil.Pod{pod}, target)
}

// TestNRIStatsWithContainersStopped: NodeGetVolumeStats of an NRI volume
// answers through a running container's mount, and, once no container
// runs, through the mounter's private mount of the volume's device: the
// same filesystem, the same usage, nothing left mounted afterwards
// (finish checks the mount tables).
func TestNRIStatsWithContainersStopped(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, pod, target := e.podWithVolume("nri-stats", mountCap(), publishOptions{})
	c := pod.RunContainer(t, "app", volumeMount("/data", target, false))
	e.exec(c, "dd if=/dev/zero of=/data/fill bs=1M count=8 conv=fsync 2>/dev/null")
	running := e.usedBytes(id, target)
	if running < 8<<20 {
		t.Errorf("used bytes with the container running: %d, want at least 8 MiB", running)
	}
	e.removeContainer(c)
	e.wantConsumers(id)
	stopped := e.usedBytes(id, target)
	if stopped != running {
		t.Errorf("used bytes with no container running: %d, with one: %d", stopped, running)
	}
	e.finish(id, []*testutil.Pod{pod}, target)
}

// usedBytes asks NodeGetVolumeStats for the bytes a volume uses.
func (e *env) usedBytes(id, target string) int64 {
	e.t.Helper()
	resp, err := e.node.NodeGetVolumeStats(e.ctx(), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
	if err != nil {
		e.t.Fatalf("NodeGetVolumeStats: %v", err)
	}
	for _, u := range resp.GetUsage() {
		if u.GetUnit() == csi.VolumeUsage_BYTES {
			return u.GetUsed()
		}
	}
	e.t.Fatalf("NodeGetVolumeStats: no bytes in %v", resp)
	return 0
}

// TestNRISubPath: a subPath volume mount in NRI mode. kubelet stats the
// subPath below the target (the guard says every name there is a
// directory) and binds it under the pod's volume-subpaths, as this test
// does; the hook finds the target and the subPath through the guard, and
// the mounter mounts the volume's own directory (made when missing, with
// the mode of the volume's root) over the container's bind at its start.
// The container sees that directory and nothing else of the volume; a
// subPath through a symlink is refused; the node's mount table never has
// the volume (the poller).
func TestNRISubPath(t *testing.T) {
	e := newEnv(t, envOptions{})
	id, pod, target := e.podWithVolume("nri-subpath", mountCap(), publishOptions{})
	whole := pod.RunContainer(t, "whole", volumeMount("/data", target, false))
	e.exec(whole, "mkdir -p /data/app && echo from-whole > /data/app/token && ln -s / /data/escape && chmod 0775 /data")

	app := pod.RunContainer(t, "app", e.subPathMount(pod, "app", "/cfg", target, "app", false))
	if got := e.exec(app, "cat /cfg/token"); got != "from-whole\n" {
		t.Errorf("the subPath container reads %q from /cfg/token", got)
	}
	if got := e.exec(app, "ls -A /cfg"); got != "token\n" {
		t.Errorf("the subPath container sees %q in /cfg, want only token (not the volume's root)", got)
	}
	if fsType, _ := e.fsAt(app, "/cfg"); fsType != "ext4" {
		t.Errorf("/cfg in the subPath container is %q, want the volume's ext4", fsType)
	}
	e.exec(app, "echo from-app > /cfg/back")
	if got := e.exec(whole, "cat /data/app/back"); got != "from-app\n" {
		t.Errorf("the whole volume's container reads %q of what the subPath container wrote", got)
	}

	// A subPath that is not there yet is made, as kubelet makes it: with
	// the mode of the volume's root.
	deep := pod.RunContainer(t, "deep", e.subPathMount(pod, "app", "/x", target, "new/deeper", false))
	e.exec(deep, "echo from-deep > /x/f")
	if got := e.exec(whole, "cat /data/new/deeper/f; stat -c %a /data/new /data/new/deeper"); got != "from-deep\n775\n775\n" {
		t.Errorf("the whole volume's container reads %q of the new subPath", got)
	}

	// A symlink on the way is never followed: the container fails to
	// start. CRI-O only logs a plugin's StartContainer error: the hook
	// kills the container before it runs, and the start fails.
	esc, err := pod.CreateContainer("escape", e.subPathMount(pod, "escape", "/esc", target, "escape", false))
	if err == nil {
		err = e.cri.StartContainer(esc)
	}
	switch {
	case e.crio() && err == nil:
		t.Errorf("a subPath through a symlink under CRI-O: the container started, want it killed before it ran")
	case e.crio():
		// CRI-O removes a container whose start failed.
		if state, serr := e.cri.ContainerState(esc); serr == nil {
			t.Errorf("the container whose subPath leads through a symlink is %s after its failed start (%v), want it gone", state, err)
		}
		esc = ""
		if log := e.sidecar.log(); !strings.Contains(log, "leads through a symlink") || !strings.Contains(log, "Killed the container before it ran") {
			t.Errorf("the sidecar's log does not say why it killed the container:\n%s", log)
		}
	case err == nil || !strings.Contains(err.Error(), "symlink"):
		t.Errorf("a subPath through a symlink: %v, want the start refused for the symlink", err)
	}
	if esc != "" {
		if err := e.cri.RemoveContainer(esc); err != nil {
			t.Error(err)
		}
	}
	e.wantConsumers(id, whole, app, deep)
	e.finish(id, []*testutil.Pod{pod}, target)
}

// subPathMount does what kubelet does for a container's subPath of the
// volume at target (pkg/volume/util/subpath): stats target/sub, opens the
// target (O_RDONLY|O_NOFOLLOW), walks sub from it one name at a time
// (O_PATH|O_NOFOLLOW), binds what it reached at the pod's volume-subpaths
// (for container ctr) through /proc/self/fd, and mounts that at dest.
func (e *env) subPathMount(pod *testutil.Pod, ctr, dest, target, sub string, readOnly bool) testutil.ContainerSpec {
	e.t.Helper()
	src := filepath.Join(target, sub)
	if fi, err := os.Stat(src); err != nil || !fi.IsDir() {
		e.t.Fatalf("kubelet's stat of the subPath %s: %v, %v; want a directory", src, fi, err)
	}
	fd, err := unix.Open(target, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		e.t.Fatalf("kubelet's open of the target %s: %v", target, err)
	}
	for _, name := range strings.Split(sub, "/") {
		next, err := unix.Openat(fd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			e.t.Fatalf("kubelet's walk of the subPath %s: %s: %v", src, name, err)
		}
		fd = next
	}
	defer unix.Close(fd)
	bound := filepath.Join(e.kubelet, "pods", pod.UID, "volume-subpaths", "v", ctr, "0")
	if err := os.MkdirAll(bound, 0o750); err != nil {
		e.t.Fatal(err)
	}
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", fd), bound, "", unix.MS_BIND, ""); err != nil {
		e.t.Fatalf("binding the subPath %s at %s: %v", src, bound, err)
	}
	e.t.Cleanup(func() {
		if err := mountns.Unmount(bound, true); err != nil {
			e.t.Error(err)
		}
	})
	return volumeMount(dest, bound, readOnly)
}
