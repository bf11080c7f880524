package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/mounter"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// leakReport is what the orderly teardown left behind under the bench's dir.
type leakReport struct {
	dir       string
	loops     []string // "loopN -> backing file"
	mounts    []string
	procs     []string // processes the bench started (or theirs) still running
	errs      []string
	forced    bool // leftovers were removed by force afterwards
	removedOK bool
}

func (l leakReport) clean() bool { return len(l.loops) == 0 && len(l.mounts) == 0 && len(l.procs) == 0 }

func (l leakReport) String() string {
	verdict := "OK"
	if !l.clean() {
		left := append(append(slices.Clone(l.loops), l.mounts...), l.procs...)
		if len(left) > 10 { // thousands after a failed measurement 8
			left = append(left[:10], fmt.Sprintf("and %d more", len(left)-10))
		}
		verdict = "LEAK: " + strings.Join(left, "; ")
		if l.forced {
			verdict += " (removed by force afterwards)"
		}
	}
	s := fmt.Sprintf("leak check: %d loop devices backed by files under %s, %d mounts under it, %d processes of the bench's plugins and mounters left: %s",
		len(l.loops), l.dir, len(l.mounts), len(l.procs), verdict)
	if !l.removedOK {
		s += "; the temp dir was NOT removed"
	}
	if len(l.errs) > 0 {
		s += " (teardown errors: " + strings.Join(l.errs, "; ") + ")"
	}
	return s
}

// teardown undoes everything, in order: what each plugin holds (through
// its RPCs), the plugins, the mounters, the consumer; then it checks for
// leftovers (loop devices, mounts, processes), removes them by force, and
// removes the temp dir.
func (b *bench) teardown() leakReport {
	rep := leakReport{dir: b.dir}
	errf := func(format string, args ...any) { rep.errs = append(rep.errs, fmt.Sprintf(format, args...)) }
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var ins []*instance
	if b.instance != nil {
		ins = b.instances()
		b.undoIO(ctx, errf)
	}
	for _, in := range ins {
		b.undo(ctx, in, errf)
	}
	if b.instance != nil && b.conn != nil && b.plugin != nil && !b.plugin.exited() && b.freshID != "" {
		if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: b.freshID, StagingTargetPath: b.staging}); err != nil {
			errf("NodeUnstageVolume %s: %v", b.freshID, err)
		}
		if _, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: b.freshID}); err != nil {
			errf("DeleteVolume %s: %v", b.freshID, err)
		}
	}
	if b.instance != nil && b.conn != nil && b.plugin != nil && !b.plugin.exited() {
		// Measurement 8 may hold thousands of volumes: a longer budget.
		sctx, scancel := context.WithTimeout(context.Background(), 15*time.Minute)
		if err := b.teardownScaleAll(sctx); err != nil {
			errf("measurement 8 volumes: %v", err)
		}
		scancel()
	}
	// The processes to be gone at the end: every child and what it
	// started (the tool spawners), seen now.
	var procs []procID
	for _, in := range ins {
		procs = append(procs, treeOf(in.plugin)...)
		procs = append(procs, treeOf(in.mounterProc)...)
	}
	procs = append(procs, treeOf(b.consumer)...)
	for _, in := range ins {
		if in.conn != nil {
			_ = in.conn.Close()
		}
		if in.plugin != nil {
			if err := in.plugin.stop(syscall.SIGTERM, 10*time.Second); err != nil {
				errf("stop plugin (%s): %v", in.label, err)
			}
		}
	}
	// The mounters after the plugins, as a node drains: the kernel clears
	// the loop devices they held that nothing mounts.
	for _, in := range ins {
		if err := in.stopMounter(); err != nil {
			errf("stop mounter (%s): %v", in.label, err)
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
	// devices with them, asynchronously, and a spawner ends once it reads
	// EOF: give them a moment.
	deadline := time.Now().Add(5 * time.Second)
	for {
		rep.loops, rep.mounts, rep.procs = loopsUnder(b.dir), mountsUnder(b.dir), alive(procs)
		if rep.clean() || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !rep.clean() {
		rep.forced = true
		killAll(procs)
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

// undo releases, through in's plugin (and mounter), what its last cycle
// left half done, and deletes its volume.
func (b *bench) undo(ctx context.Context, in *instance, errf func(string, ...any)) {
	if in.conn == nil || in.plugin == nil || in.plugin.exited() || in.volumeID == "" {
		return
	}
	if in.published {
		if _, err := in.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: in.volumeID, TargetPath: in.target}); err != nil {
			errf("NodeUnpublishVolume (%s): %v", in.label, err)
		}
	}
	if in.prepared {
		// Everything at the consumer's mount point, without a plan, as
		// `mountplan-sidecar unmount` does.
		if err := (&mounter.Executor{}).UnmountAll(ctx, in.preparedCons); err != nil {
			errf("unmount in consumer (%s): %v", in.label, err)
		}
		if _, err := in.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{
			VolumeId: in.volumeID, Consumer: plan.ConsumerToProto(in.preparedCons)}); err != nil {
			errf("NodeUnprepareVolume (%s): %v", in.label, err)
		}
	}
	// Unstage is idempotent: call it whatever the last cycle did.
	if _, err := in.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: in.volumeID, StagingTargetPath: in.staging}); err != nil {
		errf("NodeUnstageVolume (%s): %v", in.label, err)
	}
	if in.ctrl == nil { // the lean server: its image goes with the dir
		return
	}
	if _, err := in.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: in.volumeID}); err != nil {
		errf("DeleteVolume (%s): %v", in.label, err)
	}
}

// procID names a process across PID reuse: its PID and start time.
type procID struct {
	pid   int
	start uint64
	name  string
}

// treeOf is c's process and its descendants now (nil for none).
func treeOf(c *child) []procID {
	if c == nil || c.exited() {
		return nil
	}
	children := map[int][]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, ok := daemon.ReadStat(pid); ok {
			children[st.PPID] = append(children[st.PPID], pid)
		}
	}
	var out []procID
	todo := []int{c.pid()}
	for len(todo) > 0 {
		pid := todo[0]
		todo = todo[1:]
		st, ok := daemon.ReadStat(pid)
		if !ok {
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		out = append(out, procID{pid: pid, start: st.StartTime, name: c.name + ": " + strings.TrimSpace(string(comm))})
		todo = append(todo, children[pid]...)
	}
	return out
}

// alive lists the processes of ps still running (zombies are gone).
func alive(ps []procID) []string {
	var out []string
	for _, p := range ps {
		if st, ok := daemon.ReadStat(p.pid); ok && st.StartTime == p.start && st.State != 'Z' {
			out = append(out, fmt.Sprintf("pid %d (%s)", p.pid, p.name))
		}
	}
	return out
}

// killAll SIGKILLs the processes of ps still running, each by its PID once
// its start time says it is still the same process.
func killAll(ps []procID) {
	for _, p := range ps {
		if st, ok := daemon.ReadStat(p.pid); ok && st.StartTime == p.start {
			_ = unix.Kill(p.pid, unix.SIGKILL)
		}
	}
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
