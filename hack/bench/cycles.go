package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// stepper times the steps of one cycle into s (nil: a warm-up, nothing is
// recorded) with the journal writes each step made: the plugin's volume
// records and the mounter's records of in (nil for a floor).
type stepper struct {
	b     *bench
	in    *instance
	s     *sample
	steps []stepTime
}

type stepTime struct {
	name       string
	start      time.Time
	d          time.Duration
	writes     int
	recWrites  int
	benchCalls int  // calls the bench itself made to the mounter in the step
	aside      bool // not part of the cycle's total
}

// attachStep names the floor's attach: loopdev.Attach binds a number it
// detached before when it can, as the plugin does, else asks
// LOOP_CTL_GET_FREE (which walks every loop device).
const attachStep = "attach: loopdev.Attach (a number it detached, else LOOP_CTL_GET_FREE; LOOP_CONFIGURE)"

func (b *bench) steps(in *instance, s *sample) *stepper { return &stepper{b: b, in: in, s: s} }

func (st *stepper) do(name string, fn func() error) error { return st.step(name, 0, false, fn) }

// viaMounter is a step in which the bench calls the mounter itself, calls
// times.
func (st *stepper) viaMounter(name string, calls int, fn func() error) error {
	return st.step(name, calls, false, fn)
}

// aside is a step shown with the others but left out of the cycle's total.
func (st *stepper) aside(name string, fn func() error) error { return st.step(name, 0, true, fn) }

func (st *stepper) step(name string, calls int, aside bool, fn func() error) error {
	var jw, rw *writeCounter
	if st.in != nil {
		jw, rw = st.in.journal, st.in.records
	}
	jw.drain()
	rw.drain()
	t := time.Now()
	err := fn()
	d := time.Since(t)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	st.steps = append(st.steps, stepTime{name: name, start: t, d: d, writes: jw.drain(), recWrites: rw.drain(), benchCalls: calls, aside: aside})
	return nil
}

// done records a completed cycle: its steps and their sum.
func (st *stepper) done() {
	if st.s == nil {
		return
	}
	var total time.Duration
	for _, x := range st.steps {
		st.s.add(x.name, x.d)
		st.s.addWrites(x.name, x.writes, x.recWrites)
		if x.aside {
			st.s.asides[x.name] = true
		} else {
			total += x.d
		}
		if st.s.windows != nil {
			*st.s.windows = append(*st.s.windows, x)
		}
	}
	st.s.addTotal(total)
}

// publishCycle: stage, publish at target_path, unpublish, unstage through
// in's socket.
func (b *bench) publishCycle(ctx context.Context, in *instance, s *sample) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(in, s)
	if err := st.do("NodeStageVolume", func() error { return in.stage(ctx) }); err != nil {
		return err
	}
	err := st.do("NodePublishVolume", func() error {
		_, err := in.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: in.volumeID, StagingTargetPath: in.staging, TargetPath: in.target, VolumeCapability: mountCap()})
		if err == nil {
			in.published = true
		}
		return err
	})
	if err != nil {
		return err
	}
	err = st.do("NodeUnpublishVolume", func() error {
		_, err := in.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: in.volumeID, TargetPath: in.target})
		if err == nil {
			in.published = false
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := st.do("NodeUnstageVolume", func() error { return in.unstage(ctx) }); err != nil {
		return err
	}
	st.done()
	return nil
}

// floorCycle does the kernel work of the publish cycle in process.
func (b *bench) floorCycle(ctx context.Context, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(nil, s)
	var dev *loopdev.Device
	mounted := false
	defer func() { // roll back what a failed cycle left
		if mounted {
			err = errors.Join(err, unix.Unmount(b.floorDir, 0))
		}
		if dev != nil {
			err = errors.Join(err, dev.Detach())
		}
	}()
	// The plugin's options: direct I/O where the backing filesystem allows, autoclear.
	if err := st.do(attachStep, func() (err error) {
		dev, err = loopdev.Attach(ctx, b.floorImg, loopdev.Options{DirectIO: true, Autoclear: true})
		return err
	}); err != nil {
		return err
	}
	if err := st.do("mount(2) ext4 nosuid,nodev", func() error {
		err := unix.Mount(dev.Path, b.floorDir, "ext4", unix.MS_NOSUID|unix.MS_NODEV, "")
		mounted = err == nil
		return err
	}); err != nil {
		return err
	}
	if err := st.do("umount2", func() error {
		err := unix.Unmount(b.floorDir, 0)
		mounted = mounted && err != nil
		return err
	}); err != nil {
		return err
	}
	if err := st.do("detach: LOOP_CLR_FD + close (Device.Detach)", func() error {
		d := dev
		dev = nil
		return d.Detach()
	}); err != nil {
		return err
	}
	st.done()
	return nil
}

// toolsCycle does the same with util-linux.
func (b *bench) toolsCycle(ctx context.Context, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(nil, s)
	dev := ""
	mounted := false
	defer func() {
		if mounted {
			err = errors.Join(err, runTool("umount", b.floorDir))
		}
		if dev != "" {
			err = errors.Join(err, runTool("losetup", "-d", dev))
		}
	}()
	if err := st.do("losetup --find --show IMG", func() error {
		out, err := exec.Command("losetup", "--find", "--show", b.floorImg).Output()
		if err != nil {
			return fmt.Errorf("losetup: %w", exitDetail(err))
		}
		dev = strings.TrimSpace(string(out))
		return nil
	}); err != nil {
		return err
	}
	if err := st.do("mount -o nosuid,nodev DEV DIR", func() error {
		err := runTool("mount", "-o", "nosuid,nodev", dev, b.floorDir)
		mounted = err == nil
		return err
	}); err != nil {
		return err
	}
	if err := st.do("umount DIR", func() error {
		err := runTool("umount", b.floorDir)
		mounted = mounted && err != nil
		return err
	}); err != nil {
		return err
	}
	if err := st.do("losetup -d DEV", func() error {
		d := dev
		dev = ""
		return runTool("losetup", "-d", d)
	}); err != nil {
		return err
	}
	st.done()
	return nil
}

func runTool(name string, args ...string) error {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func exitDetail(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
	}
	return err
}

// prepareCycle: stage, prepare for the consumer, perform the plan in its
// namespace through the mounter that attached the device, unmount,
// unprepare, unstage. Split, that is the mounter's socket (as the sidecar's
// mount command or the NRI hook reach it); alone, a mounter.Local that
// observes the plugin's in-process mounter's records, as
// `mountplan-sidecar mount` makes one for each call (its start is shown as
// a step of its own, outside the cycle's total).
func (b *bench) prepareCycle(ctx context.Context, in *instance, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(in, s)
	cons := plan.Consumer{PID: b.consumer.pid(), MountPoint: in.consMount}
	var mounts []plan.Mount
	if err := st.do("NodeStageVolume", func() error { return in.stage(ctx) }); err != nil {
		return err
	}
	err = st.do("NodePrepareVolume", func() error {
		r, err := in.prep.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{
			VolumeId: in.volumeID, StagingTargetPath: in.staging, VolumeCapability: mountCap(),
			Consumer: &api.Consumer{Pid: int64(cons.PID), MountPoint: cons.MountPoint}})
		if err != nil {
			return err
		}
		cons.Namespace = plan.Namespace{Inode: r.GetConsumer().GetMntNsInode(), ID: r.GetConsumer().GetMntNsId()}
		mounts = plan.FromProto(r.GetMounts())
		in.prepared, in.preparedCons = true, cons
		return nil
	})
	if err != nil {
		return err
	}
	var m mounter.Interface = in.mnt
	mountStep, unmountStep, calls := mountViaSocket, unmountViaSocket, 1
	if in.split && !in.attributed {
		// The mounter serves only a namespace the runtime or an admin
		// named: once per container, as the NRI hook does at its start,
		// not in the cycle.
		if err := attribute(ctx, in, cons.PID); err != nil {
			return err
		}
		in.attributed = true
	}
	if !in.split {
		var local *mounter.Local
		if err := st.aside(observeStep, func() (err error) {
			local, err = mounter.NewNode(ctx, mounter.Options{StateDir: in.stateDir, KubeletDir: b.dir, RecordsDir: in.recordsDir, Observe: true})
			return err
		}); err != nil {
			return err
		}
		defer func() {
			if local != nil {
				err = errors.Join(err, local.Close())
			}
		}()
		m = local
		mountStep, unmountStep, calls = mountLocal, unmountLocal, 0
	}
	if err := st.viaMounter(mountStep, calls, func() error { return m.Mount(ctx, mounts, cons) }); err != nil {
		return err
	}
	if err := st.viaMounter(unmountStep, calls, func() error { return m.Unmount(ctx, mounts, cons) }); err != nil {
		return err
	}
	err = st.do("NodeUnprepareVolume", func() error {
		_, err := in.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{
			VolumeId: in.volumeID, Consumer: plan.ConsumerToProto(cons)})
		if err == nil {
			in.prepared = false
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := st.do("NodeUnstageVolume", func() error { return in.unstage(ctx) }); err != nil {
		return err
	}
	st.done()
	return nil
}

// attribute names the consumer's namespace to in's mounter, as an admin's
// `mountplan-sidecar mount` does: through a node observing its records.
func attribute(ctx context.Context, in *instance, pid int) error {
	n, err := mounter.NewNode(ctx, mounter.Options{StateDir: in.stateDir, RecordsDir: in.recordsDir, Observe: true})
	if err != nil {
		return err
	}
	_, err = n.Attribute(ctx, pid, mounter.ByAdmin, "")
	return errors.Join(err, n.Close())
}

// observeStep names the start of the observing mounter of a prepare cycle
// of the plugin alone.
const observeStep = "mounter.NewNode observing the plugin's records (mountplan-sidecar mount's start; not in the total)"

// The steps of a prepare cycle that perform the plan in the consumer's
// namespace and undo it: through the mounter's socket (split), through a
// mounter.Local in the bench (a plugin alone), and the lean server's
// equivalent, in the bench as the prepare floor does it.
const (
	mountViaSocket   = "Mount via the mounter's socket (in consumer ns)"
	unmountViaSocket = "Unmount via the mounter's socket (in consumer ns)"
	mountLocal       = "Local.Mount (in consumer ns)"
	unmountLocal     = "Local.Unmount (in consumer ns)"
	leanMount        = "the plan performed here: mountns.Build + OpenPID + Do{setns + move_mount} (in consumer ns)"
	leanUnmount      = "Do{setns + umount2} (in consumer ns)"
)

// leanStep names the step of the lean server's cycle that does what step
// does in a plugin's: an RPC by its name, the plan's performance by its
// in-process equivalent.
func leanStep(step string) string {
	switch step {
	case mountViaSocket, mountLocal:
		return leanMount
	case unmountViaSocket, unmountLocal:
		return leanUnmount
	}
	return step
}

// leanPrepareCycle is the prepare cycle of the lean server: its stage, its
// prepare (the plan of its device, from memory), the plan performed in the
// consumer's namespace by the bench as the prepare floor does it (what a
// plugin's mounter does, without the hop to it), the unmount there, its
// unprepare (nothing) and its unstage.
func (b *bench) leanPrepareCycle(ctx context.Context, in *instance, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(in, s)
	m := &nsMount{point: in.consMount}
	defer func() { err = errors.Join(err, m.close()) }()
	cons := &api.Consumer{Pid: int64(b.consumer.pid()), MountPoint: in.consMount}
	var mounts []plan.Mount
	if err := st.do("NodeStageVolume", func() error { return in.stage(ctx) }); err != nil {
		return err
	}
	err = st.do("NodePrepareVolume", func() error {
		r, err := in.prep.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{
			VolumeId: in.volumeID, StagingTargetPath: in.staging, VolumeCapability: mountCap(), Consumer: cons})
		if err != nil {
			return err
		}
		if mounts = plan.FromProto(r.GetMounts()); len(mounts) != 1 {
			return fmt.Errorf("the lean server's plan has %d mounts, want 1", len(mounts))
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := st.do(leanMount, func() error {
		if err := m.build(mounts[0]); err != nil {
			return err
		}
		return m.attach(b.consumer.pid())
	}); err != nil {
		return err
	}
	if err := st.do(leanUnmount, func() error { return errors.Join(m.unmount(), m.close()) }); err != nil {
		return err
	}
	err = st.do("NodeUnprepareVolume", func() error {
		_, err := in.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: in.volumeID, Consumer: cons})
		return err
	})
	if err != nil {
		return err
	}
	if err := st.do("NodeUnstageVolume", func() error { return in.unstage(ctx) }); err != nil {
		return err
	}
	st.done()
	return nil
}

// nsMount is a mount built in the bench's namespace and attached at a
// consumer's mount point in the consumer's, as a mounter performs a plan:
// fsopen/fsconfig/fsmount here (mountns.Build), then setns on a thread
// locked for it (mountns.Namespace.Do) and move_mount there
// (mountns.Attach). The prepare floor and the lean server's prepare cycle
// share it.
type nsMount struct {
	point   string // the mount point, as the consumer sees it
	built   *os.File
	ns      *mountns.Namespace
	mounted bool
}

func (m *nsMount) build(p plan.Mount) (err error) {
	m.built, err = mountns.Build(p)
	return err
}

// attach enters pid's namespace and moves the built mount to the mount
// point.
func (m *nsMount) attach(pid int) (err error) {
	if m.ns, err = mountns.OpenPID(pid, plan.Namespace{}); err != nil {
		return err
	}
	return m.ns.Do(func() error {
		if err := mountns.Attach(m.built, m.point); err != nil {
			return err
		}
		m.mounted = true
		// The fd pins the mount's root: close it before the umount.
		m.built.Close()
		m.built = nil
		return nil
	})
}

// unmount enters the namespace again and unmounts the mount point.
func (m *nsMount) unmount() error {
	return m.ns.Do(func() error {
		if err := unix.Unmount(m.point, unix.UMOUNT_NOFOLLOW); err != nil {
			return err
		}
		m.mounted = false
		return nil
	})
}

// close undoes what is left: the built mount's fd, the mount, the
// namespace's fd.
func (m *nsMount) close() error {
	var err error
	if m.built != nil {
		m.built.Close()
		m.built = nil
	}
	if m.mounted && m.ns != nil {
		err = m.unmount()
	}
	if m.ns != nil {
		err = errors.Join(err, m.ns.Close())
		m.ns = nil
	}
	return err
}

// prepareFloorCycle does the kernel work of the prepare cycle in process:
// the mount is built in our namespace and attached in the consumer's, then
// unmounted there. Mount and unmount each enter the namespace, as they do
// at a container's start and stop.
func (b *bench) prepareFloorCycle(ctx context.Context, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(nil, s)
	var dev *loopdev.Device
	m := &nsMount{point: b.consMount}
	defer func() {
		err = errors.Join(err, m.close())
		if dev != nil {
			err = errors.Join(err, dev.Detach())
		}
	}()
	if err := st.do(attachStep, func() (err error) {
		dev, err = loopdev.Attach(ctx, b.floorImg, loopdev.Options{DirectIO: true, Autoclear: true})
		return err
	}); err != nil {
		return err
	}
	if err := st.do("fsopen + fsconfig + fsmount (mountns.Build)", func() error {
		return m.build(plan.Mount{Type: "ext4", Source: dev.Path, Options: []string{"nosuid", "nodev"}})
	}); err != nil {
		return err
	}
	if err := st.do("OpenPID + Do{setns + move_mount} (mountns.Attach)", func() error { return m.attach(b.consumer.pid()) }); err != nil {
		return err
	}
	if err := st.do("Do{setns + umount2}", m.unmount); err != nil {
		return err
	}
	if err := st.do("detach: LOOP_CLR_FD + close (Device.Detach)", func() error {
		d := dev
		dev = nil
		return errors.Join(m.close(), d.Detach())
	}); err != nil {
		return err
	}
	st.done()
	return nil
}
