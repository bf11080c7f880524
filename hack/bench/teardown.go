package main

import (
	"context"
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
	"github.com/mountplan/mountplan/pkg/loopdev"
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
		verdict = "LEAK: " + strings.Join(append(slices.Clone(l.loops), l.mounts...), "; ")
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
	for _, f := range backingFilesUnder(b.dir) {
		devs, err := loopdev.FindByBacking(f)
		if err != nil {
			errf("find loop devices of %s: %v", f, err)
			continue
		}
		for _, d := range devs {
			if err := d.Detach(); err != nil {
				errf("detach %s: %v", d.Path, err)
			}
		}
	}
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

func backingFilesUnder(dir string) []string {
	var out []string
	for _, l := range loops() {
		if plan.Within(dir, l.backing) && !slices.Contains(out, l.backing) {
			out = append(out, l.backing)
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
