package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// leakReport is what the orderly teardown left behind under the bench's dir.
type leakReport struct {
	dir       string
	loops     []string // "loopN -> backing file"
	mounts    []string
	errs      []string
	forced    bool // leftovers were removed by force afterwards
	removedOK bool
}

func (l leakReport) clean() bool { return len(l.loops) == 0 && len(l.mounts) == 0 }

func (l leakReport) String() string {
	verdict := "OK"
	if !l.clean() {
		left := append(slices.Clone(l.loops), l.mounts...)
		if len(left) > 10 { // thousands after a failed measurement 8
			left = append(left[:10], fmt.Sprintf("and %d more", len(left)-10))
		}
		verdict = "LEAK: " + strings.Join(left, "; ")
		if l.forced {
			verdict += " (removed by force afterwards)"
		}
	}
	s := fmt.Sprintf("leak check: %d loop devices backed by files under %s, %d mounts under it: %s",
		len(l.loops), l.dir, len(l.mounts), verdict)
	if !l.removedOK {
		s += "; the temp dir was NOT removed"
	}
	if len(l.errs) > 0 {
		s += " (teardown errors: " + strings.Join(l.errs, "; ") + ")"
	}
	return s
}

// teardown undoes everything, in order: what the plugin holds (through its
// RPCs), the plugin, the consumer; then it checks for leftovers, removes them
// by force, and removes the temp dir.
func (b *bench) teardown() leakReport {
	rep := leakReport{dir: b.dir}
	errf := func(format string, args ...any) { rep.errs = append(rep.errs, fmt.Sprintf(format, args...)) }
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	if b.conn != nil && b.plugin != nil && !b.plugin.exited() && b.volumeID != "" {
		if b.published {
			if _, err := b.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: b.volumeID, TargetPath: b.target}); err != nil {
				errf("NodeUnpublishVolume: %v", err)
			}
		}
		if b.prepared {
			if err := b.exec.UnmountAll(ctx, b.preparedCons); err != nil {
				errf("unmount in consumer: %v", err)
			}
			if _, err := b.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{
				VolumeId: b.volumeID, Consumer: plan.ConsumerToProto(b.preparedCons)}); err != nil {
				errf("NodeUnprepareVolume: %v", err)
			}
		}
		// Unstage is idempotent: call it whatever the last cycle did.
		if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: b.volumeID, StagingTargetPath: b.staging}); err != nil {
			errf("NodeUnstageVolume: %v", err)
		}
		if _, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: b.volumeID}); err != nil {
			errf("DeleteVolume: %v", err)
		}
	}
	if b.conn != nil && b.plugin != nil && !b.plugin.exited() && b.freshID != "" {
		if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: b.freshID, StagingTargetPath: b.staging}); err != nil {
			errf("NodeUnstageVolume %s: %v", b.freshID, err)
		}
		if _, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: b.freshID}); err != nil {
			errf("DeleteVolume %s: %v", b.freshID, err)
		}
	}
	if b.conn != nil && b.plugin != nil && !b.plugin.exited() {
		// Measurement 8 may hold thousands of volumes: a longer budget.
		sctx, scancel := context.WithTimeout(context.Background(), 15*time.Minute)
		if err := b.teardownScaleAll(sctx); err != nil {
			errf("measurement 8 volumes: %v", err)
		}
		scancel()
	}
	if b.conn != nil {
		_ = b.conn.Close()
	}
	if b.plugin != nil {
		if err := b.plugin.stop(syscall.SIGTERM, 10*time.Second); err != nil {
			errf("stop plugin: %v", err)
		}
	}
	if b.consumer != nil {
		_ = b.consumer.stop(syscall.SIGKILL, 5*time.Second)
	}

	// The extra mounts of -mounts are ours by construction.
	for i := len(b.inflated) - 1; i >= 0; i-- {
		if err := unix.Unmount(b.inflated[i], 0); err != nil {
			errf("umount %s: %v", b.inflated[i], err)
		}
	}
	b.inflated = nil

	// The kernel drops a dead namespace's mounts, and autoclear loop
	// devices with them, asynchronously: give it a moment.
	deadline := time.Now().Add(5 * time.Second)
	for {
		rep.loops, rep.mounts = loopsUnder(b.dir), mountsUnder(b.dir)
		if rep.clean() || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !rep.clean() {
		rep.forced = true
		b.forceClean(errf)
	}
	if len(mountsUnder(b.dir)) == 0 {
		if err := os.RemoveAll(b.dir); err != nil {
			errf("remove %s: %v", b.dir, err)
		} else {
			rep.removedOK = true
		}
	}
	return rep
}

// forceClean unmounts what is mounted under the dir (deepest first) and
// detaches loop devices whose backing file lies under it.
func (b *bench) forceClean(errf func(string, ...any)) {
	ms := mountsUnder(b.dir)
	slices.SortFunc(ms, func(a, c string) int { return len(c) - len(a) })
	for _, m := range ms {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			errf("umount %s: %v", m, err)
		}
	}
	// Autoclear devices go once their mounts are gone and the plugin
	// that held them has exited: give the kernel a moment before walking
	// the devices (thousands after measurement 8).
	for deadline := time.Now().Add(5 * time.Second); len(loopsUnder(b.dir)) > 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	// By name, as losetup -d would: FindByBacking walks every device for
	// each file, thousands of times over after measurement 8.
	for _, l := range loops() {
		if plan.Within(b.dir, l.backing) {
			if err := detachByName(l.name, b.dir); err != nil {
				errf("detach %s: %v", l.name, err)
			}
		}
	}
}

// detachByName clears the loop device /dev/<name> (LOOP_CLR_FD) if, with
// it open, its backing file still lies under dir.
func detachByName(name, dir string) error {
	f, err := os.OpenFile("/dev/"+name, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	data, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file")
	if err != nil || !plan.Within(dir, strings.TrimSuffix(strings.TrimSpace(string(data)), " (deleted)")) {
		return nil // released, or someone else's by now
	}
	err = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
	if errors.Is(err, unix.ENXIO) {
		return nil // released meanwhile
	}
	return err
}

type loopInfo struct{ name, backing string }

func loops() []loopInfo {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []loopInfo
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue // detached while we looked
		}
		out = append(out, loopInfo{
			name:    filepath.Base(filepath.Dir(filepath.Dir(f))),
			backing: strings.TrimSuffix(strings.TrimSpace(string(data)), " (deleted)"),
		})
	}
	return out
}

func loopsUnder(dir string) []string {
	var out []string
	for _, l := range loops() {
		if plan.Within(dir, l.backing) {
			out = append(out, l.name+" -> "+l.backing)
		}
	}
	return out
}

// mountsUnder lists the mount points at or below dir in our namespace.
func mountsUnder(dir string) []string {
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return []string{"(cannot read mountinfo: " + err.Error() + ")"}
	}
	var out []string
	for _, i := range infos {
		out = append(out, i.Mountpoint)
	}
	return out
}
