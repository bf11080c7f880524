//go:build linux

package service_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// attributedFixture is a mounter as mountplan-sidecar serve runs it
// (Options.Attributed), reached through its socket as the plugin reaches
// it, and an admin's one-shot node beside it over the same records.
type attributedFixture struct {
	dir, state, kubelet, records string
	c                            *service.Client
}

func newAttributedFixture(t *testing.T) *attributedFixture {
	t.Helper()
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "nsenter", "mount")
	f := &attributedFixture{dir: mountnstest.Scratch(t)}
	f.state = filepath.Join(f.dir, "state")
	f.kubelet = filepath.Join(f.dir, "kubelet")
	f.records = filepath.Join(f.dir, "records")
	for _, d := range []string{filepath.Join(f.state, "images"), f.kubelet} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	f.c = serveWith(t, mounter.Options{StateDir: f.state, KubeletDir: f.kubelet, RecordsDir: f.records,
		Config: &config.Config{}, Attributed: true})
	return f
}

// attribute names pid's namespace as an admin's one-shot mount command
// does: through a node of its own that observes the serving one's records.
func (f *attributedFixture) attribute(t *testing.T, pid int) {
	t.Helper()
	n, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: f.state, KubeletDir: f.kubelet,
		RecordsDir: f.records, Config: &config.Config{}, Observe: true})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if _, err := n.Attribute(context.Background(), pid, mounter.ByAdmin, ""); err != nil {
		t.Fatal(err)
	}
}

// inNS runs a command in pid's mount namespace.
func inNS(t *testing.T, pid int, args ...string) {
	t.Helper()
	out, err := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(pid), "-m", "--"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("nsenter %v: %v: %s", args, err, out)
	}
}

// mountedAt reports whether p is a mount point in pid's namespace.
func mountedAt(t *testing.T, pid int, p string) bool {
	t.Helper()
	for _, m := range mountnstest.MountsUnder(t, pid, filepath.Dir(p)) {
		if m.Mountpoint == p {
			return true
		}
	}
	return false
}

// TestAttributedNamespaces (issue 33, F1): through its socket, the mounter
// enters only a namespace that the runtime or an admin named. The
// reviewer's recipe: a host service's private namespace rooted at the
// host's "/" (udevd's, made here by unshare -m) gets a bind of a state-dir
// directory holding a udev rule at its rules directory; the process there
// must never see the rule. At b705b24 the Mount succeeded and the rule was
// readable.
func TestAttributedNamespaces(t *testing.T) {
	f := newAttributedFixture(t)
	ctx := context.Background()
	planted := filepath.Join(f.state, "p")
	if err := os.MkdirAll(planted, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(planted, "99-hsec.rules"), []byte(`RUN+="/bin/sh -c id"`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rulesDir := filepath.Join(f.dir, "run-udev", "rules.d")
	if err := os.MkdirAll(rulesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	bind := []plan.Mount{{Type: plan.TypeBind, Source: planted, Options: []string{"nosuid", "nodev"}}}
	udevd := mountnstest.Namespace(t, "private")
	err := f.c.Mount(ctx, bind, plan.Consumer{PID: udevd, MountPoint: rulesDir})
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("Mount into a host-rooted namespace nobody named = %v, want PermissionDenied", err)
	}
	rule := filepath.Join("/proc", strconv.Itoa(udevd), "root", rulesDir, "99-hsec.rules")
	if _, err := os.Stat(rule); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the namespace sees the planted rule (%v): the bind reached it", err)
	}
	if mountedAt(t, udevd, rulesDir) {
		t.Errorf("%s is a mount point in the namespace", rulesDir)
	}
	if _, err := f.c.StatFS(ctx, plan.Consumer{PID: udevd, MountPoint: "/etc"}); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("StatFS in a namespace nobody named = %v, want PermissionDenied", err)
	}

	// Once an admin named it, the same namespace is served, and its
	// mount point is released again.
	named := mountnstest.Namespace(t, "private")
	f.attribute(t, named)
	tmpfs := []plan.Mount{{Type: "tmpfs", Source: "mp-attr", Options: []string{"nosuid", "nodev"}}}
	mp := filepath.Join(f.dir, "mp")
	c := plan.Consumer{PID: named, MountPoint: mp}
	if err := f.c.Mount(ctx, tmpfs, c); err != nil {
		t.Fatalf("Mount into a namespace an admin named: %v", err)
	}
	if !mountedAt(t, named, mp) {
		t.Fatalf("nothing mounted at %s", mp)
	}
	if _, err := f.c.StatFS(ctx, c); err != nil {
		t.Errorf("StatFS of the named namespace's mount: %v", err)
	}
	for i := range 2 {
		if err := f.c.Unmount(ctx, tmpfs, c); err != nil {
			t.Fatalf("Unmount %d: %v", i, err)
		}
	}
	if mountedAt(t, named, mp) {
		t.Errorf("%s still mounted after Unmount", mp)
	}
}

// TestUnmountOnlyWhatItMade (issue 33, F6): the mounter unmounts nothing
// it did not mount, whatever the plan says it is. The reviewer's recipe:
// in a consumer's namespace, Unmount of {tmpfs, tmpfs} at a read-only
// tmpfs mask and of {proc, proc} at a read-only bind of /proc/sys (what
// runc puts in every container), and at PID 0 of another pod's secret
// tmpfs below the kubelet dir. At b705b24 each returned nil and the mount
// was gone.
func TestUnmountOnlyWhatItMade(t *testing.T) {
	f := newAttributedFixture(t)
	ctx := context.Background()
	container := mountnstest.Namespace(t, "private")
	f.attribute(t, container)
	mask := filepath.Join(f.dir, "mask")
	procSys := filepath.Join(f.dir, "proc-sys")
	secret := filepath.Join(f.kubelet, "pods", "uid", "volumes", "kubernetes.io~secret", "token")
	for _, d := range []string{mask, procSys, secret} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	inNS(t, container, "mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", mask)
	inNS(t, container, "mount", "--bind", "/proc/sys", procSys)
	inNS(t, container, "mount", "-o", "remount,bind,ro", procSys)
	if err := unix.Mount("tmpfs", secret, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(secret, unix.MNT_DETACH) })

	for _, tt := range []struct {
		name  string
		mount plan.Mount
		c     plan.Consumer
		pid   int
	}{
		{"a container's tmpfs mask", plan.Mount{Type: "tmpfs", Source: "tmpfs"}, plan.Consumer{PID: container, MountPoint: mask}, container},
		{"runc's read-only /proc/sys", plan.Mount{Type: "proc", Source: "proc"}, plan.Consumer{PID: container, MountPoint: procSys}, container},
		{"another pod's secret tmpfs (pid 0)", plan.Mount{Type: "tmpfs", Source: "tmpfs"}, plan.Consumer{MountPoint: secret}, os.Getpid()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := f.c.Unmount(ctx, []plan.Mount{tt.mount}, tt.c)
			if !errors.Is(err, errdefs.ErrPermissionDenied) {
				t.Errorf("Unmount = %v, want PermissionDenied", err)
			}
			if !mountedAt(t, tt.pid, tt.c.MountPoint) {
				t.Errorf("the mount at %s is gone", tt.c.MountPoint)
			}
		})
	}

	// What the mounter did mount there is still its to unmount, also
	// after a restart (a new node over the same records), at PID 0 as in
	// a container.
	target := filepath.Join(f.kubelet, "pods", "uid", "volumes", "kubernetes.io~csi", "pv", "mount")
	tmpfs := []plan.Mount{{Type: "tmpfs", Source: "mp-made", Options: []string{"nosuid", "nodev"}}}
	for _, c := range []plan.Consumer{{MountPoint: target}, {PID: container, MountPoint: filepath.Join(f.dir, "made")}} {
		if err := f.c.Mount(ctx, tmpfs, c); err != nil {
			t.Fatalf("Mount at %s: %v", c.MountPoint, err)
		}
	}
	again := serveWith(t, mounter.Options{StateDir: f.state, KubeletDir: f.kubelet, RecordsDir: f.records,
		Config: &config.Config{}, Attributed: true})
	for _, c := range []plan.Consumer{{MountPoint: target}, {PID: container, MountPoint: filepath.Join(f.dir, "made")}} {
		if err := again.Unmount(ctx, tmpfs, c); err != nil {
			t.Errorf("Unmount of its own mount at %s after a restart: %v", c.MountPoint, err)
		}
		pid := c.PID
		if pid == 0 {
			pid = os.Getpid()
		}
		if mountedAt(t, pid, c.MountPoint) {
			t.Errorf("%s still mounted", c.MountPoint)
		}
	}
	inNS(t, container, "umount", mask)
	inNS(t, container, "umount", procSys)
}

// TestAttributedContainer: a real container's namespace (pivot_root-ed,
// not rooted at the host's "/") is refused too until it is named, then
// served, with the mount seen inside it only.
func TestAttributedContainer(t *testing.T) {
	f := newAttributedFixture(t)
	ctx := context.Background()
	ctr := mountnstest.Container(t)
	tmpfs := []plan.Mount{{Type: "tmpfs", Source: "mp-ctr", Options: []string{"nosuid", "nodev"}}}
	c := plan.Consumer{PID: ctr, MountPoint: "/tmp/vol"}
	if err := f.c.Mount(ctx, tmpfs, c); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("Mount into a container nobody named = %v, want PermissionDenied", err)
	}
	f.attribute(t, ctr)
	if err := f.c.Mount(ctx, tmpfs, c); err != nil {
		t.Fatalf("Mount into a named container: %v", err)
	}
	if !mountedAt(t, ctr, "/tmp/vol") {
		t.Fatalf("nothing mounted at /tmp/vol inside the container")
	}
	if err := f.c.Unmount(ctx, tmpfs, c); err != nil {
		t.Fatal(err)
	}
	if mountedAt(t, ctr, "/tmp/vol") {
		t.Errorf("/tmp/vol still mounted in the container")
	}
}
