package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

const (
	imageSize  = 64 << 20
	scaleSize  = 16 << 20 // measurement 8's volumes
	volumeName = "mpbench-vol"
)

type bench struct {
	o options

	dir      string // the one temporary dir: everything below is ours
	floorDir string // mount point of the in-process and util-linux floors
	floorImg string // a sparse copy of the formatted volume image

	// The main instance (the current build, split unless -alone), whose
	// fields the measurements use directly; others take turns with it in
	// measurements 1 and 4.
	*instance
	alone  *instance // -hop: the current build alone (mounter in process)
	before *instance // -compare: the other plugin binary, alone
	lean   *instance // -lean: the lean CSI node server

	consumer *child
	freshID  string // the volume of measurement 6 that exists now, if any

	scale scaleState // measurement 8's volumes
	io    *ioState   // -io: the I/O benchmark's volumes

	inflateDir string   // -mounts: where the extra mounts are
	inflated   []string // -mounts: the extra mounts made so far
}

// instances are the main instance and the others, in that order.
func (b *bench) instances() []*instance {
	out := []*instance{b.instance}
	for _, in := range []*instance{b.alone, b.before, b.lean} {
		if in != nil {
			out = append(out, in)
		}
	}
	return out
}

func newBench(o options) (*bench, error) {
	if err := os.MkdirAll(o.baseDir, 0o755); err != nil {
		return nil, err
	}
	base, err := filepath.Abs(o.baseDir)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(base, "mpbench-")
	if err != nil {
		return nil, err
	}
	// MkdirTemp may return a path through a symlink; the kernel reports
	// mount points and backing files resolved.
	if dir, err = filepath.EvalSymlinks(dir); err != nil {
		return nil, err
	}
	b := &bench{
		o:        o,
		dir:      dir,
		floorDir: filepath.Join(dir, "floor-mnt"),
		floorImg: filepath.Join(dir, "floor.img"),
	}
	if err := os.MkdirAll(b.floorDir, 0o750); err != nil {
		return b, err
	}
	now := "now"
	if rev := revision(o.plugin); rev != "" {
		now += " (" + rev + ")"
	}
	if b.instance, err = newInstance(dir, "", now+", "+shapeWord(!o.alone), o.plugin, !o.alone); err != nil {
		return b, err
	}
	// The others take turns in measurements 1 and 4 only.
	if !o.phases[1] && !o.phases[4] {
		return b, nil
	}
	if o.hop && !o.alone {
		if b.alone, err = newInstance(dir, "alone", now+", "+shapeWord(false), o.plugin, false); err != nil {
			return b, err
		}
	}
	if o.compare != "" && o.phases[1] {
		label := "before"
		switch rev := revision(o.compare); {
		case o.compareLabel != "":
			label += " (" + o.compareLabel + ")"
		case rev != "":
			label += " (" + rev + ")"
		default:
			label += " (" + filepath.Base(o.compare) + ")"
		}
		if b.before, err = newInstance(dir, "before", label+", "+shapeWord(false), o.compare, false); err != nil {
			return b, err
		}
	}
	if o.lean != "" {
		if b.lean, err = newInstance(dir, "lean", leanLabel, o.lean, false); err != nil {
			return b, err
		}
		b.lean.lean = true
	}
	return b, nil
}

// leanLabel names the lean CSI node server in the reports.
const leanLabel = "lean CSI server (grpc-go, syscalls only)"

func shapeWord(split bool) string {
	if split {
		return "split (plugin + mounter)"
	}
	return "plugin alone (mounter in process)"
}

func mountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// Numbers of the samples of the other instances, which take turns with
// measurement 1 (publish) and 4 (prepare); measurement 6 uses 6 to 9.
const (
	nAlonePublish  = 10 // the current build alone (-hop)
	nBeforePublish = 11 // the -compare binary alone
	nAlonePrepare  = 12 // the current build alone (-hop)
	nLeanPublish   = 13 // the lean CSI node server (-lean)
	nLeanPrepare   = 14 // the lean CSI node server (-lean), the plan performed in process
)

// measure sets up and runs the selected measurements. The results gathered
// so far are returned with an error.
func (b *bench) measure(ctx context.Context) (*results, error) {
	res := &results{o: b.o, env: describeEnv(b.dir), shape: b.instance.label}
	if b.before != nil {
		res.before = b.before.label
	}
	if b.o.mounts > 0 {
		if err := b.inflateMounts(); err != nil {
			return nil, err
		}
		res.env += fmt.Sprintf("; private mount namespace with %d extra mounts (%d in its table)", b.o.mounts, countMounts())
	}
	// Every measurement needs the main instance: the floors use a copy of
	// the image its first stage formatted.
	for _, in := range b.instances() {
		if err := b.startInstance(ctx, in); err != nil {
			return nil, err
		}
	}
	if b.o.phases[4] || b.o.phases[5] || b.o.phases[8] {
		if err := b.startConsumer(ctx); err != nil {
			return res, err
		}
	}
	defer func() {
		for _, in := range b.instances() {
			in.journal.close()
			in.records.close()
		}
	}()
	var err error
	type phase struct {
		n    int
		sel  int // the measurement (-phases) it belongs to
		name string
		in   *instance // the instance a socket cycle runs on; nil for a floor
		fn   func(context.Context, *sample) error
	}
	publish := func(in *instance) func(context.Context, *sample) error {
		return func(ctx context.Context, s *sample) error { return b.publishCycle(ctx, in, s) }
	}
	prepare := func(in *instance) func(context.Context, *sample) error {
		return func(ctx context.Context, s *sample) error { return b.prepareCycle(ctx, in, s) }
	}
	// A socket cycle and its floor run in turn, cycle by cycle, so that a
	// drift in the machine's load hits both alike and their ratio holds;
	// so do the other instances' cycles.
	g1 := []phase{{1, 1, "publish cycle via socket: stage + publish + unpublish + unstage, " + b.instance.label, b.instance, publish(b.instance)}}
	g4 := []phase{{4, 4, "prepare cycle via socket: stage + prepare + mount in consumer ns + unmount + unprepare + unstage, " + b.instance.label, b.instance, prepare(b.instance)}}
	if b.alone != nil {
		g1 = append(g1, phase{nAlonePublish, 1, "publish cycle via socket, " + b.alone.label, b.alone, publish(b.alone)})
		g4 = append(g4, phase{nAlonePrepare, 4, "prepare cycle via socket, " + b.alone.label, b.alone, prepare(b.alone)})
	}
	if b.before != nil {
		g1 = append(g1, phase{nBeforePublish, 1, "publish cycle via socket, " + b.before.label, b.before, publish(b.before)})
	}
	if b.lean != nil {
		g1 = append(g1, phase{nLeanPublish, 1, "publish cycle via socket, " + b.lean.label, b.lean, publish(b.lean)})
		g4 = append(g4, phase{nLeanPrepare, 4, "prepare cycle via socket, " + b.lean.label + ", the plan performed in process", b.lean,
			func(ctx context.Context, s *sample) error { return b.leanPrepareCycle(ctx, b.lean, s) }})
	}
	g1 = append(g1, phase{2, 2, "floor, direct syscalls: attach + mount + umount + detach", nil, b.floorCycle})
	g4 = append(g4, phase{5, 5, "prepare floor: attach + fsopen/fsmount + setns + move_mount + umount in ns + detach", nil, b.prepareFloorCycle})
	groups := [][]phase{g1, {{3, 3, "util-linux tools: losetup --find --show, mount, umount, losetup -d", nil, b.toolsCycle}}, g4}
	for _, g := range groups {
		g = slices.DeleteFunc(slices.Clone(g), func(p phase) bool { return !b.o.phases[p.sel] })
		if len(g) == 0 {
			continue
		}
		samples := make([]*sample, len(g))
		for i, p := range g {
			samples[i] = newSample(p.n, p.name)
			samples[i].in = p.in
			b.logf("measurement %d: %d warm-ups, %d timed", p.n, b.o.warmup, b.o.n)
			for j := 0; j < b.o.warmup; j++ {
				if err = p.fn(ctx, nil); err != nil {
					return res, fmt.Errorf("measurement %d, warm-up %d: %w", p.n, j+1, err)
				}
			}
		}
		// The calls each step of a split cycle makes to the mounter,
		// counted once, untimed (strace of the plugin).
		for i, p := range g {
			if p.in != nil && p.in.split {
				samples[i].mounterCalls = b.countMounterCalls(ctx, p.in, p.fn)
			}
		}
		// Each instance is used by its own cycles only: its plugin's and
		// mounter's CPU time and metrics over the group are theirs.
		type before struct {
			pluginCPU, mounterCPU time.Duration
			cpuErr                error
			metrics               map[string]hist
		}
		was := make([]before, len(g))
		for i, p := range g {
			if p.in == nil {
				continue
			}
			was[i].pluginCPU, was[i].cpuErr = procCPU(p.in.plugin)
			if p.in.mounterProc != nil {
				was[i].mounterCPU, _ = procCPU(p.in.mounterProc)
			}
			was[i].metrics, _ = b.scrape(ctx, p.in)
		}
		var stopTrace func() string
		if b.o.straceOut != "" && g[0].in == b.instance {
			if stopTrace, err = b.straceOn(g[0].in, fmt.Sprintf("%s.cycle%d", b.o.straceOut, g[0].n)); err != nil {
				return res, err
			}
		}
		runtime.GC()
		failed := 0
	timed:
		for j := 0; j < b.o.n; j++ {
			for i, p := range g {
				if err = p.fn(ctx, samples[i]); err != nil {
					failed = p.n
					break timed
				}
			}
		}
		for i, p := range g {
			if p.in == nil {
				continue
			}
			if cpu1, err := procCPU(p.in.plugin); err == nil && was[i].cpuErr == nil {
				samples[i].pluginCPU = (cpu1 - was[i].pluginCPU) / time.Duration(b.o.n)
			}
			if p.in.mounterProc != nil {
				if cpu1, err := procCPU(p.in.mounterProc); err == nil {
					samples[i].mounterCPU = (cpu1 - was[i].mounterCPU) / time.Duration(b.o.n)
				}
			}
			if was[i].metrics != nil {
				if m1, err := b.scrape(ctx, p.in); err == nil {
					samples[i].inPlugin = meansBetween(was[i].metrics, m1)
				}
			}
		}
		if stopTrace != nil {
			res.straces = append(res.straces, fmt.Sprintf("cycle %d:\n%s", g[0].n, stopTrace()))
		}
		if err != nil {
			return res, fmt.Errorf("measurement %d: %w", failed, err)
		}
		res.samples = append(res.samples, samples...)
	}
	if b.o.phases[6] {
		if err := b.measureFirstStage(ctx, res); err != nil {
			return res, err
		}
	}
	if b.o.phases[7] {
		if err := b.measureDataPath(ctx, res); err != nil {
			return res, fmt.Errorf("measurement 7: %w", err)
		}
	}
	if b.o.phases[8] {
		if err := b.measureScale(ctx, res); err != nil {
			return res, fmt.Errorf("measurement 8: %w", err)
		}
	}
	if b.o.phases[9] {
		if res.nri, err = b.measureNRIHook(ctx); err != nil {
			return res, fmt.Errorf("measurement 9: %w", err)
		}
	}
	res.journalWrite = b.measureJournalWrite(ctx)
	res.noopRPC = b.measureNoopRPC(ctx)
	res.mounterRPC = b.measureMounterRPC(ctx)
	return res, nil
}

// startInstance starts in's mounter (split) and plugin, creates its volume
// and starts counting its record writes; for the lean server, starts it and
// gives it its image.
func (b *bench) startInstance(ctx context.Context, in *instance) error {
	if in.lean {
		b.logf("starting the lean server in %s", in.root)
		if err := b.startLean(ctx, in); err != nil {
			return err
		}
		return b.leanVolume(ctx, in)
	}
	if in.split {
		b.logf("starting mounter (%s) in %s", in.label, in.root)
		if err := b.startMounter(ctx, in); err != nil {
			return err
		}
	}
	b.logf("starting plugin (%s) in %s", in.label, in.root)
	if err := b.startPlugin(ctx, in); err != nil {
		return err
	}
	if err := b.createVolume(ctx, in); err != nil {
		return fmt.Errorf("%s: %w", in.label, err)
	}
	var err error
	if in.journal, err = newWriteCounter(filepath.Join(in.stateDir, "volumes")); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %s: not counting journal writes: %v\n", in.label, err)
	}
	// The mounter's records: the loop devices it attached, the mounts it
	// made below the state dir. A plugin from before the split has none.
	if in.records, err = newWriteCounter(filepath.Join(in.recordsDir, "loops"), filepath.Join(in.recordsDir, "mounts")); err != nil && in == b.instance {
		fmt.Fprintf(os.Stderr, "bench: %s: not counting the mounter's record writes: %v\n", in.label, err)
	}
	return nil
}

// createVolume provisions in's volume and stages and unstages it once, so
// that it is formatted before anything is timed; the floors use a sparse
// copy of the main instance's formatted image, on the same filesystem.
func (b *bench) createVolume(ctx context.Context, in *instance) error {
	in.node, in.ctrl, in.prep = csi.NewNodeClient(in.conn), csi.NewControllerClient(in.conn), api.NewNodePrepareClient(in.conn)
	r, err := in.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               volumeName,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: imageSize},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap()},
	})
	if err != nil {
		return fmt.Errorf("CreateVolume: %w", err)
	}
	in.volumeID = r.GetVolume().GetVolumeId()
	if err := in.stage(ctx); err != nil {
		return fmt.Errorf("first stage (format): %w", err)
	}
	if err := in.unstage(ctx); err != nil {
		return err
	}
	if in != b.instance {
		return nil
	}
	st, err := journal.OpenVolumes(in.stateDir)
	if err != nil {
		return err
	}
	v, err := st.Get(in.volumeID)
	if err != nil {
		return err
	}
	if v.Format == nil || !v.Format.Done || v.Format.FsType != "ext4" {
		return fmt.Errorf("volume %s was not formatted ext4 by its first stage: %+v", in.volumeID, v.Format)
	}
	in.image = v.Image
	b.logf("volume %s, image %s", in.volumeID, in.image)
	return sparseCopy(in.image, b.floorImg)
}

// leanVolume gives the lean server its volume: a sparse copy of the main
// instance's formatted image (as the floors have), which every stage names
// in its volume context (the server makes and removes target_path, as a
// plugin does); one stage and unstage before
// anything is timed. The main instance has started before.
func (b *bench) leanVolume(ctx context.Context, in *instance) error {
	if b.instance.image == "" {
		return fmt.Errorf("%s: the main instance has no formatted image to copy", in.label)
	}
	in.node, in.prep = csi.NewNodeClient(in.conn), api.NewNodePrepareClient(in.conn)
	in.volumeID = "mpbench-lean-vol"
	in.image = filepath.Join(in.root, "lean.img")
	in.volumeContext = map[string]string{"image": in.image} // leancsi's imageKey
	if err := sparseCopy(b.instance.image, in.image); err != nil {
		return err
	}
	if err := in.stage(ctx); err != nil {
		return fmt.Errorf("%s: %w", in.label, err)
	}
	return in.unstage(ctx)
}

func (in *instance) stage(ctx context.Context) error {
	_, err := in.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: in.volumeID, StagingTargetPath: in.staging, VolumeCapability: mountCap(), VolumeContext: in.volumeContext})
	if err != nil {
		return fmt.Errorf("NodeStageVolume: %w", err)
	}
	in.staged = true
	return nil
}

func (in *instance) unstage(ctx context.Context) error {
	if _, err := in.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{
		VolumeId: in.volumeID, StagingTargetPath: in.staging}); err != nil {
		return fmt.Errorf("NodeUnstageVolume: %w", err)
	}
	in.staged = false
	return nil
}

// sparseCopy copies src to dst, leaving holes where src reads as zeros.
func sparseCopy(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	var off int64
	for {
		n, rerr := io.ReadFull(in, buf)
		if n > 0 {
			if strings.Trim(string(buf[:n]), "\x00") != "" {
				if _, err := out.WriteAt(buf[:n], off); err != nil {
					out.Close()
					return err
				}
			}
			off += int64(n)
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			out.Close()
			return rerr
		}
	}
	if err := out.Truncate(off); err != nil {
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// measureJournalWrite times one journal record write of each durability
// in a scratch store next to the plugin's records: the unit costs of the
// journal on this filesystem.
func (b *bench) measureJournalWrite(ctx context.Context) *sample {
	s := newSample(0, "journal.Store.Put of a volume record")
	dir := filepath.Join(b.stateDir, "bench-journal")
	defer os.RemoveAll(dir)
	st, err := journal.OpenVolumes(dir)
	if err != nil {
		return nil
	}
	v := &model.Volume{ID: "probe", Kind: model.KindProvisioned, Type: "loop", Image: strings.Repeat("x", 200)}
	for _, d := range []struct {
		name string
		d    journal.Durability
	}{{"runtime (one pwrite in place)", journal.Runtime}, {"durable (write + fsync + rename + fsync dir)", journal.Durable}} {
		for i := 0; i < b.o.warmup+b.o.n && ctx.Err() == nil; i++ {
			t := time.Now()
			if _, err := st.Put(v.ID, v, d.d); err != nil {
				return nil
			}
			if i >= b.o.warmup {
				s.add(d.name, time.Since(t))
			}
		}
	}
	return s
}

// measureNoopRPC times GetPluginInfo, which does no work in the plugin:
// the cost of one unary call over the socket (client, HTTP/2 framing,
// interceptor, protosanitizer, scheduling on both sides).
func (b *bench) measureNoopRPC(ctx context.Context) *sample {
	s := newSample(0, "GetPluginInfo round trip")
	id := csi.NewIdentityClient(b.conn)
	for i := 0; i < b.o.warmup+b.o.n && ctx.Err() == nil; i++ {
		t := time.Now()
		if _, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil {
			return nil
		}
		if i >= b.o.warmup {
			s.add("GetPluginInfo", time.Since(t))
		}
	}
	return s
}

// measureMounterRPC times a call to the main instance's mounter that has
// nothing to do (mounterNoop): the cost of one hop over internal/unixrpc. nil
// without a mounter process.
func (b *bench) measureMounterRPC(ctx context.Context) *sample {
	if b.mnt == nil {
		return nil
	}
	s := newSample(0, "mounter round trip")
	for i := 0; i < b.o.warmup+b.o.n && ctx.Err() == nil; i++ {
		t := time.Now()
		if err := mounterNoop(ctx, b.mnt); err != nil {
			return nil
		}
		if i >= b.o.warmup {
			s.add("LiveNamespaces of a consumer without namespace", time.Since(t))
		}
	}
	return s
}

// procCPU is the CPU time (user + system) c has used so far, from
// /proc/PID/stat, which includes its exited threads.
func procCPU(c *child) (time.Duration, error) {
	if c == nil {
		return 0, errors.New("no such process")
	}
	pid := c.pid()
	st, ok := daemon.ReadStat(pid)
	if !ok {
		return 0, fmt.Errorf("cannot read /proc/%d/stat: has the %s exited?", pid, c.name)
	}
	const clkTck = 100 // USER_HZ: the unit of /proc times on every Linux architecture Go supports
	return time.Duration(st.UTime+st.STime) * time.Second / clkTck, nil
}

// inflateMounts adds o.mounts small tmpfs mounts under dir/inflate. Only
// with -mounts, which runs the bench in a private mount namespace.
func (b *bench) inflateMounts() error {
	if os.Getenv(inNamespaceEnv) == "" {
		return fmt.Errorf("-mounts needs the private mount namespace the bench starts itself in")
	}
	b.inflateDir = filepath.Join(b.dir, "inflate")
	for i := range b.o.mounts {
		p := filepath.Join(b.inflateDir, fmt.Sprint(i))
		if err := os.MkdirAll(p, 0o700); err != nil {
			return err
		}
		if err := unix.Mount("mpbench", p, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k"); err != nil {
			return fmt.Errorf("mount tmpfs at %s: %w", p, err)
		}
		b.inflated = append(b.inflated, p)
	}
	return nil
}

func countMounts() int {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return -1
	}
	return strings.Count(string(data), "\n")
}

// describeEnv names the machine and the filesystem under the bench's dir.
func describeEnv(dir string) string {
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	fs := "?"
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) == nil {
		switch st.Type {
		case unix.EXT4_SUPER_MAGIC:
			fs = "ext4"
		case unix.TMPFS_MAGIC:
			fs = "tmpfs"
		case unix.XFS_SUPER_MAGIC:
			fs = "xfs"
		case unix.BTRFS_SUPER_MAGIC:
			fs = "btrfs"
		default:
			fs = fmt.Sprintf("magic 0x%x", st.Type)
		}
	}
	return fmt.Sprintf("Linux %s, %d CPUs, %s; temp dir %s (%s)",
		unix.ByteSliceToString(uts.Release[:]), runtime.NumCPU(), runtime.Version(), dir, fs)
}
