//go:build linux

package mounter_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// TestHostileRequests sends the mounter what a compromised plugin (or
// anything else that reaches its socket) could: each row is a call and the
// gRPC code it must end with (errdefs.Code is what the Mounter service's
// interceptor answers). After all of them, nothing is mounted anywhere.
func TestHostileRequests(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	// A directory under /dev, which a bind would expose whole, and in it a
	// SCSI disk node with no iSCSI session behind it (8:0 is sda).
	devDir := devTestDir(t)
	sda := filepath.Join(devDir, "sda")
	mknodBlock(t, sda, unix.Mkdev(8, 0))
	kubelet := filepath.Join(dir, "kubelet")
	state := filepath.Join(dir, "state")
	images := filepath.Join(state, "images")
	outside := filepath.Join(dir, "outside")
	mkdirs(t, kubelet, images, outside)
	e := node(t, mounter.Options{StateDir: state, KubeletDir: kubelet})
	// A disk the mounter never set up: a loop device of an image outside
	// the image roots stands for the host's disk; one attached by someone
	// else to an image inside them (losetup: another driver, an admin)
	// is no better.
	hostDisk := mountnstest.LoopDevice(t, outside, "ext4", 16)
	foreign := mountnstest.LoopDevice(t, images, "ext4", 16)
	volume := volumeDevice(t, e, state, "ext4", 16)
	// Review finding 1c: an NBD device the mounter did not connect (43:0)
	// and a SCSI disk of a session it did not log in (8:16); this kernel
	// may have neither, the nodes stand for them.
	nbd0, sdb := filepath.Join(devDir, "nbd0"), filepath.Join(devDir, "sdb")
	mknodBlock(t, nbd0, unix.Mkdev(43, 0))
	mknodBlock(t, sdb, unix.Mkdev(8, 16))
	many := []plan.Mount{tmpfs("many-0", "")}
	for i := 1; i <= plan.MaxMounts; i++ {
		many = append(many, tmpfs("many-"+strconv.Itoa(i), "d"+strconv.Itoa(i)))
	}
	container := mountnstest.Namespace(t, "private")
	fakeHost := mountnstest.Namespace(t, "private")
	// Review finding 1a: something mounted on a directory of the state
	// dir: a host directory (a tmpfs outside the roots stands for /etc)
	// bound onto one, the host's disk mounted on another.
	victim := filepath.Join(outside, "victim")
	mkdirs(t, victim, filepath.Join(state, "x"), filepath.Join(state, "y"))
	mountTmpfs(t, "mp-victim", victim)
	writeFile(t, filepath.Join(victim, "marker"), "host secret\n")
	bindMount(t, victim, filepath.Join(state, "x"))
	if err := unix.Mount(hostDisk, filepath.Join(state, "y"), "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(filepath.Join(state, "y"), unix.MNT_DETACH) })
	mp := filepath.Join(dir, "mp")
	in := plan.Consumer{PID: container, MountPoint: mp}
	safe := []string{"nosuid", "nodev"}
	ext4 := func(dev string) []plan.Mount { return []plan.Mount{{Type: "ext4", Source: dev, Options: safe}} }
	bind := func(src string) []plan.Mount {
		return []plan.Mount{{Type: "bind", Source: src, Options: []string{"nosuid"}}}
	}
	tmpfsPlan := []plan.Mount{tmpfs("t", "")}

	type call int
	const (
		mount call = iota
		unmount
		unmountAll
	)
	tests := []struct {
		name   string
		call   call
		mounts []plan.Mount
		c      plan.Consumer
		want   codes.Code
	}{
		// Devices: only what the plugin set up for a staged volume.
		{"ext4 of the host's disk", mount, ext4(hostDisk), in, codes.PermissionDenied},
		{"ext4 ro of the host's disk", mount, []plan.Mount{{Type: "ext4", Source: hostDisk, Options: opts("ro")}}, in, codes.PermissionDenied},
		{"ext4 of a SCSI disk that is no iSCSI session's", mount, ext4(sda), in, codes.PermissionDenied},
		{"bind of the host's disk node", mount, bind(hostDisk), in, codes.PermissionDenied},
		{"bind of a SCSI disk node", mount, bind(sda), in, codes.PermissionDenied},
		{"bind of /dev/null (a character device)", mount, bind("/dev/null"), in, codes.PermissionDenied},
		{"bind of a directory under /dev", mount, bind(devDir), in, codes.PermissionDenied},
		{"ext4 of a device that does not exist", mount, ext4("/dev/mountplan-none"), in, codes.NotFound},
		{"ext4 of a loop device the mounter did not attach (finding 1b)", mount, ext4(foreign), in, codes.PermissionDenied},
		{"bind of an NBD device the mounter did not connect (finding 1c)", mount, bind(nbd0), in, codes.PermissionDenied},
		{"bind of a disk of an iSCSI session the mounter did not log in (finding 1c)", mount, bind(sdb), in, codes.PermissionDenied},
		{"bind of a host directory bound on the state dir (finding 1a)", mount,
			[]plan.Mount{{Type: "bind", Source: filepath.Join(state, "x"), Options: safe}}, in, codes.PermissionDenied},
		{"bind of the host's disk mounted on the state dir (finding 1a)", mount,
			[]plan.Mount{{Type: "bind", Source: filepath.Join(state, "y"), Options: safe}}, in, codes.PermissionDenied},
		{"noload (finding 1b)", mount, []plan.Mount{{Type: "ext4", Source: volume, Options: opts("noload")}}, in, codes.InvalidArgument},
		{"norecovery (finding 1b)", mount, []plan.Mount{{Type: "ext4", Source: volume, Options: opts("norecovery")}}, in, codes.InvalidArgument},
		{"a plan of more mounts than MaxMounts (finding 6b)", mount, many, in, codes.InvalidArgument},
		{"ext4 of a path outside /dev", mount, ext4(filepath.Join(images, "x.img")), in, codes.InvalidArgument},
		{"lowerdir under /dev", mount, []plan.Mount{{Type: "overlay", Source: "o", Options: opts("lowerdir=/dev/shm")}}, in, codes.InvalidArgument},
		{"lowerdir under the state dir (a path the kernel resolves after the checks)", mount,
			[]plan.Mount{{Type: "overlay", Source: "o", Options: opts("lowerdir=" + state)}}, in, codes.InvalidArgument},
		{"bind of a host path outside the roots", mount, bind("/etc"), in, codes.InvalidArgument},
		{"errors=panic", mount, []plan.Mount{{Type: "ext4", Source: volume, Options: opts("errors=panic")}}, in, codes.InvalidArgument},
		{"suid and dev", mount, []plan.Mount{{Type: "ext4", Source: volume, Options: []string{"suid", "dev"}}}, in, codes.InvalidArgument},
		// Consumers: never the host's namespace or the mounter's own.
		{"pid 0 outside the kubelet dir", mount, tmpfsPlan, plan.Consumer{MountPoint: outside}, codes.PermissionDenied},
		{"pid 0 beside the kubelet dir", mount, tmpfsPlan, plan.Consumer{MountPoint: kubelet + "-x/y"}, codes.PermissionDenied},
		{"pid 0 at the kubelet dir itself", mount, tmpfsPlan, plan.Consumer{MountPoint: kubelet}, codes.PermissionDenied},
		{"pid 0 at /", mount, tmpfsPlan, plan.Consumer{MountPoint: "/"}, codes.InvalidArgument},
		{"pid 1", mount, tmpfsPlan, plan.Consumer{PID: 1, MountPoint: mp}, codes.PermissionDenied},
		{"a process of the mounter's own namespace", mount, tmpfsPlan, plan.Consumer{PID: os.Getpid(), MountPoint: mp}, codes.PermissionDenied},
		{"a process of the host's namespace", mount, tmpfsPlan, plan.Consumer{PID: fakeHost, MountPoint: mp}, codes.PermissionDenied},
		{"negative pid", mount, tmpfsPlan, plan.Consumer{PID: -1, MountPoint: mp}, codes.InvalidArgument},
		{"relative mount point", mount, tmpfsPlan, plan.Consumer{PID: container, MountPoint: "etc"}, codes.InvalidArgument},
		{"target with ..", mount, []plan.Mount{tmpfs("t", "../../etc")}, in, codes.InvalidArgument},
		{"unmount of pid 0 outside the kubelet dir", unmount, ext4(hostDisk), plan.Consumer{MountPoint: outside}, codes.PermissionDenied},
		{"unmount in the host's namespace", unmount, tmpfsPlan, plan.Consumer{PID: fakeHost, MountPoint: mp}, codes.PermissionDenied},
		{"unmount-all of pid 0 outside the kubelet dir", unmountAll, nil, plan.Consumer{MountPoint: outside}, codes.PermissionDenied},
		{"unmount-all of pid 1", unmountAll, nil, plan.Consumer{PID: 1, MountPoint: outside}, codes.PermissionDenied},
		{"unmount-all of the mounter's own namespace", unmountAll, nil, plan.Consumer{PID: os.Getpid(), MountPoint: dir}, codes.PermissionDenied},
	}
	restore := mounter.SetHostNS("/proc/" + strconv.Itoa(fakeHost) + "/ns/mnt")
	defer restore()
	ctx := context.Background()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var err error
			switch tt.call {
			case mount:
				err = e.Mount(ctx, tt.mounts, tt.c)
			case unmount:
				err = e.Unmount(ctx, tt.mounts, tt.c)
			case unmountAll:
				err = e.UnmountAll(ctx, tt.c)
			}
			if got := errdefs.Code(err); got != tt.want {
				t.Fatalf("got %v (%v), want %v", got, err, tt.want)
			}
		})
	}
	// Host paths in the rows are below dir, where Scratch's leak check
	// looks too: a regression must not mount over the test machine's /etc.
	// (The test's own namespace holds the two mounts finding 1a plants.)
	for _, pid := range []int{container, fakeHost} {
		if n := countMounts(t, pid, dir); n != 0 {
			t.Errorf("%d mounts in the namespace of pid %d after refused calls", n, pid)
		}
	}
	if n := countMounts(t, 0, dir); n != 3 {
		t.Errorf("%d mounts below %s in the test's namespace after refused calls, want the 3 the test made", n, dir)
	}
	// The controls: the volume's device is mounted in the container, and
	// a publish below the kubelet dir in the mounter's own namespace.
	if err := e.Mount(ctx, ext4(volume), in); err != nil {
		t.Fatalf("the volume's own device: %v", err)
	}
	if err := e.Unmount(ctx, ext4(volume), in); err != nil {
		t.Fatal(err)
	}
	// The kubelet dir may be named through a symlink (moved to another
	// disk): a publish below either name is kubelet's.
	kubeletLink := filepath.Join(dir, "kubelet-link")
	if err := os.Symlink(kubelet, kubeletLink); err != nil {
		t.Fatal(err)
	}
	e = node(t, mounter.Options{StateDir: state, KubeletDir: kubeletLink})
	for _, mp := range []string{filepath.Join(kubelet, "pods", "p", "mount"), filepath.Join(kubeletLink, "pods", "q", "mount")} {
		publish := plan.Consumer{MountPoint: mp}
		if err := e.Mount(ctx, tmpfsPlan, publish); err != nil {
			t.Fatalf("a publish below the kubelet dir: %v", err)
		}
		if err := e.UnmountAll(ctx, publish); err != nil {
			t.Fatal(err)
		}
	}
}
