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

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/loopdev"
	"github.com/mountplan/mountplan/pkg/mountns"
	"github.com/mountplan/mountplan/pkg/plan"
)

// stepper times the steps of one cycle into s (nil: a warm-up, nothing is
// recorded) with the journal writes each step made.
type stepper struct {
	b     *bench
	s     *sample
	steps []stepTime
}

type stepTime struct {
	name   string
	d      time.Duration
	writes int
}

// attachStep names the floor's attach: loopdev.Attach binds a number it
// detached before when it can, as the plugin does, else asks
// LOOP_CTL_GET_FREE (which walks every loop device).
const attachStep = "attach: loopdev.Attach (a number it detached, else LOOP_CTL_GET_FREE; LOOP_CONFIGURE)"

func (b *bench) steps(s *sample) *stepper { return &stepper{b: b, s: s} }

func (st *stepper) do(name string, fn func() error) error {
	st.b.journal.drain()
	t := time.Now()
	err := fn()
	d := time.Since(t)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	st.steps = append(st.steps, stepTime{name: name, d: d, writes: st.b.journal.drain()})
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
		st.s.addWrites(x.name, x.writes)
		total += x.d
	}
	st.s.addTotal(total)
}

// publishCycle: stage, publish at target_path, unpublish, unstage through
// the socket.
func (b *bench) publishCycle(ctx context.Context, s *sample) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(s)
	if err := st.do("NodeStageVolume", func() error { return b.stage(ctx) }); err != nil {
		return err
	}
	err := st.do("NodePublishVolume", func() error {
		_, err := b.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: b.volumeID, StagingTargetPath: b.staging, TargetPath: b.target, VolumeCapability: mountCap()})
		if err == nil {
			b.published = true
		}
		return err
	})
	if err != nil {
		return err
	}
	err = st.do("NodeUnpublishVolume", func() error {
		_, err := b.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: b.volumeID, TargetPath: b.target})
		if err == nil {
			b.published = false
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := st.do("NodeUnstageVolume", func() error { return b.unstage(ctx) }); err != nil {
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
	st := b.steps(s)
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
	st := b.steps(s)
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
// namespace with the in-process executor, unmount, unprepare, unstage.
func (b *bench) prepareCycle(ctx context.Context, s *sample) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(s)
	cons := plan.Consumer{PID: b.consumer.pid(), MountPoint: b.consMount}
	var mounts []plan.Mount
	if err := st.do("NodeStageVolume", func() error { return b.stage(ctx) }); err != nil {
		return err
	}
	err := st.do("NodePrepareVolume", func() error {
		r, err := b.prep.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{
			VolumeId: b.volumeID, StagingTargetPath: b.staging, VolumeCapability: mountCap(),
			Consumer: &api.Consumer{Pid: int64(cons.PID), MountPoint: cons.MountPoint}})
		if err != nil {
			return err
		}
		cons.Namespace.Inode = r.GetConsumer().GetMntNsInode()
		mounts = plan.FromProto(r.GetMounts())
		b.prepared, b.preparedCons = true, cons
		return nil
	})
	if err != nil {
		return err
	}
	if err := st.do("Executor.Mount (in consumer ns)", func() error { return b.exec.Mount(ctx, mounts, cons) }); err != nil {
		return err
	}
	if err := st.do("Executor.Unmount (in consumer ns)", func() error { return b.exec.Unmount(ctx, mounts, cons) }); err != nil {
		return err
	}
	err = st.do("NodeUnprepareVolume", func() error {
		_, err := b.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{
			VolumeId: b.volumeID, Consumer: plan.ConsumerToProto(cons)})
		if err == nil {
			b.prepared = false
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := st.do("NodeUnstageVolume", func() error { return b.unstage(ctx) }); err != nil {
		return err
	}
	st.done()
	return nil
}

// prepareFloorCycle does the kernel work of the prepare cycle in process:
// the mount is built in our namespace and attached in the consumer's, then
// unmounted there. Mount and unmount each enter the namespace, as they do
// at a container's start and stop.
func (b *bench) prepareFloorCycle(ctx context.Context, s *sample) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	st := b.steps(s)
	var (
		dev     *loopdev.Device
		built   *os.File
		ns      *mountns.Namespace
		mounted bool
	)
	defer func() {
		if built != nil {
			built.Close()
		}
		if mounted && ns != nil {
			err = errors.Join(err, ns.Do(func() error { return unix.Unmount(b.consMount, unix.UMOUNT_NOFOLLOW) }))
		}
		if ns != nil {
			ns.Close()
		}
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
	if err := st.do("fsopen + fsconfig + fsmount (mountns.Build)", func() (err error) {
		built, err = mountns.Build(plan.Mount{Type: "ext4", Source: dev.Path, Options: []string{"nosuid", "nodev"}})
		return err
	}); err != nil {
		return err
	}
	if err := st.do("OpenPID + Do{setns + move_mount} (mountns.Attach)", func() (err error) {
		if ns, err = mountns.OpenPID(b.consumer.pid(), plan.Namespace{}); err != nil {
			return err
		}
		return ns.Do(func() error {
			if err := mountns.Attach(built, b.consMount); err != nil {
				return err
			}
			mounted = true
			// The fd pins the mount's root: close it before the umount.
			built.Close()
			built = nil
			return nil
		})
	}); err != nil {
		return err
	}
	if err := st.do("Do{setns + umount2}", func() error {
		return ns.Do(func() error {
			if err := unix.Unmount(b.consMount, unix.UMOUNT_NOFOLLOW); err != nil {
				return err
			}
			mounted = false
			return nil
		})
	}); err != nil {
		return err
	}
	if err := st.do("detach: LOOP_CLR_FD + close (Device.Detach)", func() error {
		n := ns
		ns = nil
		d := dev
		dev = nil
		return errors.Join(n.Close(), d.Detach())
	}); err != nil {
		return err
	}
	st.done()
	return nil
}
