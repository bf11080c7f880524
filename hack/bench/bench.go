package main

import (
	"context"
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
	"google.golang.org/grpc"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

const (
	imageSize  = 64 << 20
	scaleSize  = 16 << 20 // measurement 8's volumes
	volumeName = "mpbench-vol"
)

type bench struct {
	o options

	dir       string // the one temporary dir: everything below is ours
	stateDir  string // the plugin's --state-dir
	sock      string
	pluginLog string
	staging   string // staging_target_path (the plugin mounts nothing there)
	target    string // target_path of NodePublishVolume
	floorDir  string // mount point of the in-process and util-linux floors
	consMount string // the consumer's mount point, as its namespace sees it
	floorImg  string // a sparse copy of the formatted volume image

	metricsAddr string // the plugin's --metrics-address, "" if it has none
	// reconcileInterval is the plugin's --reconcile-interval ("" for 1h);
	// the last start took pluginListening from exec to the socket
	// accepting, pluginReady to Probe ready.
	reconcileInterval            string
	pluginListening, pluginReady time.Duration

	plugin   *child
	consumer *child
	conn     *grpc.ClientConn
	node     csi.NodeClient
	ctrl     csi.ControllerClient
	prep     api.NodePrepareClient
	exec     *mounter.Executor
	volumeID string
	freshID  string // the volume of measurement 6 that exists now, if any
	image    string
	journal  *writeCounter

	scale scaleState // measurement 8's volumes

	inflateDir string   // -mounts: where the extra mounts are
	inflated   []string // -mounts: the extra mounts made so far

	// What a cycle left half done, for the teardown.
	published, prepared, staged bool
	preparedCons                plan.Consumer
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
		o:         o,
		dir:       dir,
		stateDir:  filepath.Join(dir, "state"),
		sock:      filepath.Join(dir, "csi.sock"),
		pluginLog: filepath.Join(dir, "plugin.log"),
		staging:   filepath.Join(dir, "staging"),
		target:    filepath.Join(dir, "publish", "target"),
		floorDir:  filepath.Join(dir, "floor-mnt"),
		consMount: filepath.Join(dir, "consumer-mnt"),
		floorImg:  filepath.Join(dir, "floor.img"),
	}
	for _, d := range []string{b.stateDir, b.staging, filepath.Dir(b.target), b.floorDir, b.consMount} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return b, err
		}
	}
	b.exec = &mounter.Executor{Policy: (&config.Config{DefaultFsType: "ext4"}).PlanPolicy(b.stateDir), KubeletDir: b.dir}
	return b, nil
}

func mountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// measure sets up and runs the selected measurements. The results gathered
// so far are returned with an error.
func (b *bench) measure(ctx context.Context) (*results, error) {
	res := &results{o: b.o, env: describeEnv(b.dir)}
	if b.o.mounts > 0 {
		if err := b.inflateMounts(); err != nil {
			return nil, err
		}
		res.env += fmt.Sprintf("; private mount namespace with %d extra mounts (%d in its table)", b.o.mounts, countMounts())
	}
	// Every measurement needs the plugin: the floors use a copy of the
	// image its first stage formatted.
	b.logf("starting plugin in %s", b.dir)
	if err := b.startPlugin(ctx); err != nil {
		return nil, err
	}
	if err := b.createVolume(ctx); err != nil {
		return nil, err
	}
	if b.o.phases[4] || b.o.phases[5] || b.o.phases[8] {
		if err := b.startConsumer(ctx); err != nil {
			return res, err
		}
	}
	var err error
	wc, werr := newWriteCounter(filepath.Join(b.stateDir, "volumes"))
	if werr != nil {
		fmt.Fprintln(os.Stderr, "bench: not counting journal writes:", werr)
	} else {
		b.journal = wc
		defer wc.close()
	}

	type phase struct {
		n    int
		name string
		fn   func(context.Context, *sample) error
	}
	// A socket cycle and its floor run in turn, cycle by cycle, so that a
	// drift in the machine's load hits both alike and their ratio holds.
	groups := [][]phase{
		{{1, "publish cycle via socket: stage + publish + unpublish + unstage", b.publishCycle},
			{2, "floor, direct syscalls: attach + mount + umount + detach", b.floorCycle}},
		{{3, "util-linux tools: losetup --find --show, mount, umount, losetup -d", b.toolsCycle}},
		{{4, "prepare cycle via socket: stage + prepare + Executor.Mount in consumer ns + Executor.Unmount + unprepare + unstage", b.prepareCycle},
			{5, "prepare floor: attach + fsopen/fsmount + setns + move_mount + umount in ns + detach", b.prepareFloorCycle}},
	}
	for _, g := range groups {
		g = slices.DeleteFunc(slices.Clone(g), func(p phase) bool { return !b.o.phases[p.n] })
		if len(g) == 0 {
			continue
		}
		samples := make([]*sample, len(g))
		for i, p := range g {
			samples[i] = newSample(p.n, p.name)
			b.logf("measurement %d: %d warm-ups, %d timed", p.n, b.o.warmup, b.o.n)
			for j := 0; j < b.o.warmup; j++ {
				if err = p.fn(ctx, nil); err != nil {
					return res, fmt.Errorf("measurement %d, warm-up %d: %w", p.n, j+1, err)
				}
			}
		}
		// Only socket cycles (1, 4) use the plugin: its CPU time and
		// metrics over the group are theirs.
		socket := g[0].n == 1 || g[0].n == 4
		cpu0, cpuErr := b.pluginCPU()
		var m0 map[string]hist
		if socket {
			m0, _ = b.scrape(ctx)
		}
		var stopTrace func() string
		if b.o.straceOut != "" && socket {
			if stopTrace, err = b.straceOn(fmt.Sprintf("%s.cycle%d", b.o.straceOut, g[0].n)); err != nil {
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
		if cpu1, err := b.pluginCPU(); err == nil && cpuErr == nil && socket {
			samples[0].pluginCPU = (cpu1 - cpu0) / time.Duration(b.o.n)
		}
		if m0 != nil {
			if m1, err := b.scrape(ctx); err == nil {
				samples[0].inPlugin = meansBetween(m0, m1)
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
	res.journalWrite = b.measureJournalWrite(ctx)
	res.noopRPC = b.measureNoopRPC(ctx)
	return res, nil
}

// createVolume provisions the volume and stages and unstages it once, so
// that it is formatted before anything is timed; the floors use a sparse
// copy of the formatted image, on the same filesystem.
func (b *bench) createVolume(ctx context.Context) error {
	b.node, b.ctrl, b.prep = csi.NewNodeClient(b.conn), csi.NewControllerClient(b.conn), api.NewNodePrepareClient(b.conn)
	r, err := b.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               volumeName,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: imageSize},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap()},
	})
	if err != nil {
		return fmt.Errorf("CreateVolume: %w", err)
	}
	b.volumeID = r.GetVolume().GetVolumeId()
	if err := b.stage(ctx); err != nil {
		return fmt.Errorf("first stage (format): %w", err)
	}
	if err := b.unstage(ctx); err != nil {
		return err
	}
	st, err := journal.Open(b.stateDir)
	if err != nil {
		return err
	}
	v, err := st.Get(b.volumeID)
	if err != nil {
		return err
	}
	if v.Format == nil || !v.Format.Done || v.Format.FsType != "ext4" {
		return fmt.Errorf("volume %s was not formatted ext4 by its first stage: %+v", b.volumeID, v.Format)
	}
	b.image = v.Image
	b.logf("volume %s, image %s", b.volumeID, b.image)
	return sparseCopy(b.image, b.floorImg)
}

func (b *bench) stage(ctx context.Context) error {
	_, err := b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: b.volumeID, StagingTargetPath: b.staging, VolumeCapability: mountCap()})
	if err != nil {
		return fmt.Errorf("NodeStageVolume: %w", err)
	}
	b.staged = true
	return nil
}

func (b *bench) unstage(ctx context.Context) error {
	if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{
		VolumeId: b.volumeID, StagingTargetPath: b.staging}); err != nil {
		return fmt.Errorf("NodeUnstageVolume: %w", err)
	}
	b.staged = false
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
	st, err := journal.Open(dir)
	if err != nil {
		return nil
	}
	v := &journal.Volume{ID: "probe", Kind: journal.KindProvisioned, Type: "loop", Image: strings.Repeat("x", 200)}
	for _, d := range []struct {
		name string
		d    journal.Durability
	}{{"runtime (one pwrite in place)", journal.Runtime}, {"durable (write + fsync + rename + fsync dir)", journal.Durable}} {
		for i := 0; i < b.o.warmup+b.o.n && ctx.Err() == nil; i++ {
			t := time.Now()
			if err := st.Put(v, d.d); err != nil {
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

// pluginCPU is the CPU time (user + system) the plugin has used so far,
// from /proc/PID/stat, which includes its exited threads.
func (b *bench) pluginCPU() (time.Duration, error) {
	pid := b.plugin.pid()
	st, ok := daemon.ReadStat(pid)
	if !ok {
		return 0, fmt.Errorf("cannot read /proc/%d/stat: has the plugin exited?", pid)
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
