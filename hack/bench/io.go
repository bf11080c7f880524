package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/daemon"
)

// The I/O benchmark (-io, make bench-io): fio against each kind of volume
// as a consumer sees it (kubelet's target path of a NodePublishVolume
// through the plugin's socket, the mounter a process of its own), beside
// the same workload on the thing underneath it, in one run. Every
// workload runs on every target in turn, round after round, so that a
// drift of the machine's load hits a volume and its backing alike.
//
// The kinds and what each is held against:
//   - loop ext4, loop xfs: a provisioned volume (a sparse image on a loop
//     device) against a file on the host filesystem that holds the image,
//     both with O_DIRECT;
//   - chain: a writable overlay over a squashfs image with a scratch ext4
//     upper (upperSize), against a file on that upper filesystem beside the
//     overlay's upper directory, both with O_DIRECT;
//   - squashfuse: a file in a squashfs image served by squashfuse in fd
//     mode, against the same file through the kernel's squashfs of the
//     same image (mount -o loop); read-only and buffered (neither takes
//     O_DIRECT): fio drops the file's cached pages before each job, the
//     bench the image's and the loop device's, and each job is one pass
//     over the file (every read cold), at most the runtime.

// ioWorkload is one fio job shape.
type ioWorkload struct {
	Name  string `json:"name"`
	RW    string `json:"rw"` // fio's --rw
	BS    string `json:"bs"`
	Depth int    `json:"iodepth"`
}

func (w ioWorkload) writes() bool { return strings.Contains(w.RW, "write") }

var ioWorkloads = []ioWorkload{
	{"4k randread QD1", "randread", "4k", 1},
	{"4k randread QD32", "randread", "4k", 32},
	{"4k randwrite QD1", "randwrite", "4k", 1},
	{"4k randwrite QD32", "randwrite", "4k", 32},
	{"1M read QD8", "read", "1M", 8},
	{"1M write QD8", "write", "1M", 8},
}

// ioKind is one kind of volume, set up through the plugin, and its backing.
type ioKind struct {
	name     string // "loop ext4"
	backing  string // what the backing target is, for the report
	readOnly bool   // no write workloads
	direct   bool   // fio --direct=1 on both targets

	volumeID string
	staging  string
	target   string // kubelet's target path
	created  bool   // provisioned by CreateVolume (deleted at the end)
	staged   bool
	pub      bool

	volFile, rawFile string // the files fio works on
	kernelMount      string // squashfuse: the kernel's squashfs, ours to unmount
	settle           []string
	daemon           string // the daemon's command name, whose CPU time is counted
}

// ioState is what the I/O benchmark made, for the teardown.
type ioState struct {
	dir   string
	kinds []*ioKind
}

// fioFigures are one fio job's figures for one direction.
type fioFigures struct {
	IOs     int64   `json:"ios"`
	Seconds float64 `json:"seconds"`
	IOPS    float64 `json:"iops"`
	MBps    float64 `json:"mb_per_s"` // 10^6 bytes
	P50us   float64 `json:"p50_us"`
	P99us   float64 `json:"p99_us"`
	// CPU time of the processes serving the volume per I/O, in µs:
	// plugin, mounter, daemon (zero for the backing, and without one).
	PluginCPUus  float64 `json:"plugin_cpu_us_per_io"`
	MounterCPUus float64 `json:"mounter_cpu_us_per_io"`
	DaemonCPUus  float64 `json:"daemon_cpu_us_per_io"`
	// fio's own CPU time per I/O (user + system), the consumer's side.
	FioCPUus float64 `json:"fio_cpu_us_per_io"`
}

// ioResult is one kind and workload: the volume and its backing, summed
// over the rounds (latencies: the mean of the rounds' percentiles).
type ioResult struct {
	Kind     string     `json:"kind"`
	Backing  string     `json:"backing"`
	Workload ioWorkload `json:"workload"`
	Direct   bool       `json:"direct"`
	Volume   fioFigures `json:"volume"`
	Raw      fioFigures `json:"backing_figures"`
	Ratio    float64    `json:"iops_ratio"` // volume IOPS / backing IOPS
	rounds   int
}

// measureIO sets up every kind asked for, runs the workloads round after
// round and returns the results. b.io holds what it made for the teardown.
func (b *bench) measureIO(ctx context.Context) ([]*ioResult, error) {
	kinds, err := b.setupIO(ctx)
	if err != nil {
		return nil, err
	}
	var results []*ioResult
	byKey := map[string]*ioResult{}
	for round := 0; round < b.o.ioRounds; round++ {
		for _, w := range ioWorkloads {
			for _, k := range kinds {
				if k.readOnly && w.writes() {
					continue
				}
				key := k.name + "/" + w.Name
				r := byKey[key]
				if r == nil {
					r = &ioResult{Kind: k.name, Backing: k.backing, Workload: w, Direct: k.direct}
					byKey[key] = r
					results = append(results, r)
				}
				b.logf("io: round %d, %s, %s", round+1, k.name, w.Name)
				vol, err := b.fioOn(ctx, k, w, k.volFile, true)
				if err != nil {
					return results, fmt.Errorf("%s, %s: %w", k.name, w.Name, err)
				}
				raw, err := b.fioOn(ctx, k, w, k.rawFile, false)
				if err != nil {
					return results, fmt.Errorf("%s backing, %s: %w", k.name, w.Name, err)
				}
				r.add(vol, raw)
			}
		}
	}
	for _, r := range results {
		r.finish()
	}
	return results, nil
}

func (r *ioResult) add(vol, raw fioFigures) {
	for _, p := range []struct {
		sum *fioFigures
		x   fioFigures
	}{{&r.Volume, vol}, {&r.Raw, raw}} {
		p.sum.IOs += p.x.IOs
		p.sum.Seconds += p.x.Seconds
		p.sum.MBps += p.x.MBps * p.x.Seconds // weighted, divided in finish
		p.sum.P50us += p.x.P50us
		p.sum.P99us += p.x.P99us
		p.sum.PluginCPUus += p.x.PluginCPUus * float64(p.x.IOs)
		p.sum.MounterCPUus += p.x.MounterCPUus * float64(p.x.IOs)
		p.sum.DaemonCPUus += p.x.DaemonCPUus * float64(p.x.IOs)
		p.sum.FioCPUus += p.x.FioCPUus * float64(p.x.IOs)
	}
	r.rounds++
}

func (r *ioResult) finish() {
	for _, f := range []*fioFigures{&r.Volume, &r.Raw} {
		if f.Seconds > 0 {
			f.IOPS = float64(f.IOs) / f.Seconds
			f.MBps /= f.Seconds
		}
		f.P50us /= float64(r.rounds)
		f.P99us /= float64(r.rounds)
		if f.IOs > 0 {
			n := float64(f.IOs)
			f.PluginCPUus, f.MounterCPUus, f.DaemonCPUus, f.FioCPUus = f.PluginCPUus/n, f.MounterCPUus/n, f.DaemonCPUus/n, f.FioCPUus/n
		}
	}
	if r.Raw.IOPS > 0 {
		r.Ratio = r.Volume.IOPS / r.Raw.IOPS
	}
}

// fioOn runs workload w on file for the configured runtime and returns its
// figures; on the volume (vol), with the CPU time of the plugin, the
// mounter and the kind's daemon per I/O.
func (b *bench) fioOn(ctx context.Context, k *ioKind, w ioWorkload, file string, vol bool) (fioFigures, error) {
	if err := settle(k.settle); err != nil {
		return fioFigures{}, err
	}
	args := []string{"--output-format=json", "--name=" + strings.ReplaceAll(w.Name, " ", "-"),
		"--filename=" + file, "--rw=" + w.RW, "--bs=" + w.BS, "--iodepth=" + strconv.Itoa(w.Depth),
		"--ioengine=libaio", "--runtime=" + strconv.Itoa(b.o.ioRuntime), "--randrepeat=0",
		"--invalidate=1", "--group_reporting"}
	if k.direct {
		// Round and round the file for the runtime: nothing is cached.
		args = append(args, "--direct=1", "--time_based", "--norandommap")
	}
	// Buffered (a read-only kind): one pass over the file, each block
	// read once (fio's random map), at most for the runtime, so that every
	// read is cold after the settle and fio's invalidate; round and round,
	// the second pass would measure the page cache.
	if k.readOnly {
		args = append(args, "--readonly")
	} else {
		args = append(args, "--size="+strconv.FormatInt(b.o.ioSize, 10))
	}
	var procs []cpuOf
	if vol {
		procs = b.servingProcs(k)
	}
	before := cpuTimes(procs)
	cmd := exec.CommandContext(ctx, "fio", args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fioFigures{}, fmt.Errorf("fio %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	after := cpuTimes(procs)
	f, err := parseFio(out, w.writes())
	if err != nil {
		return f, err
	}
	if f.IOs > 0 {
		per := func(role string) float64 {
			return float64(after[role]-before[role]) / float64(time.Microsecond) / float64(f.IOs)
		}
		f.PluginCPUus, f.MounterCPUus, f.DaemonCPUus = per("plugin"), per("mounter"), per("daemon")
	}
	return f, nil
}

// fioJSON is the part of fio's JSON output the bench reads.
type fioJSON struct {
	Jobs []struct {
		Error  int     `json:"error"`
		UsrCPU float64 `json:"usr_cpu"` // percent of the job's runtime
		SysCPU float64 `json:"sys_cpu"`
		Read   fioDir  `json:"read"`
		Write  fioDir  `json:"write"`
	} `json:"jobs"`
}

type fioDir struct {
	IOs     int64   `json:"total_ios"`
	BwBytes float64 `json:"bw_bytes"`
	IOPS    float64 `json:"iops"`
	Runtime int64   `json:"runtime"` // ms
	Clat    struct {
		Percentile map[string]float64 `json:"percentile"`
	} `json:"clat_ns"`
}

func parseFio(out []byte, writes bool) (fioFigures, error) {
	// fio may print notes before its JSON.
	if i := strings.IndexByte(string(out), '{'); i > 0 {
		out = out[i:]
	}
	var j fioJSON
	if err := json.Unmarshal(out, &j); err != nil {
		return fioFigures{}, fmt.Errorf("fio's JSON: %w", err)
	}
	if len(j.Jobs) != 1 {
		return fioFigures{}, fmt.Errorf("fio's JSON: %d jobs, want 1", len(j.Jobs))
	}
	job := j.Jobs[0]
	if job.Error != 0 {
		return fioFigures{}, fmt.Errorf("fio: job error %d (%s)", job.Error, unix.Errno(job.Error))
	}
	d := job.Read
	if writes {
		d = job.Write
	}
	f := fioFigures{IOs: d.IOs, Seconds: float64(d.Runtime) / 1000, IOPS: d.IOPS, MBps: d.BwBytes / 1e6,
		P50us: d.Clat.Percentile["50.000000"] / 1000, P99us: d.Clat.Percentile["99.000000"] / 1000}
	if d.IOs > 0 {
		f.FioCPUus = (job.UsrCPU + job.SysCPU) / 100 * f.Seconds * 1e6 / float64(d.IOs)
	}
	if d.IOs == 0 || d.Runtime == 0 {
		return f, errors.New("fio did no I/O")
	}
	return f, nil
}

// cpuOf is a process whose CPU time is counted under a role.
type cpuOf struct {
	role string // "plugin", "mounter", "daemon"
	p    procID
}

// servingProcs are the processes that serve k's volume: the plugin, the
// mounter and, for a FUSE volume, its daemon (below the mounter).
func (b *bench) servingProcs(k *ioKind) []cpuOf {
	var out []cpuOf
	for _, p := range treeOf(b.plugin) {
		out = append(out, cpuOf{"plugin", p})
	}
	for i, p := range treeOf(b.mounterProc) {
		role := "mounter"
		if i > 0 {
			if k.daemon == "" || !strings.HasSuffix(p.name, ": "+k.daemon) {
				continue
			}
			role = "daemon"
		}
		out = append(out, cpuOf{role, p})
	}
	return out
}

// cpuTimes sums the CPU time (user + system, exited threads included) of
// procs by role.
func cpuTimes(procs []cpuOf) map[string]time.Duration {
	const clkTck = 100 // USER_HZ
	m := map[string]time.Duration{}
	for _, c := range procs {
		if st, ok := daemon.ReadStat(c.p.pid); ok && st.StartTime == c.p.start {
			m[c.role] += time.Duration(st.UTime+st.STime) * time.Second / clkTck
		}
	}
	return m
}

// settle writes back and drops the cached pages of each path (a file or a
// block device), so that a buffered read job starts from the disk.
func settle(paths []string) error {
	for _, p := range paths {
		f, err := os.OpenFile(p, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeDevice != 0 {
			err = unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)
			if err != nil {
				f.Close()
				return fmt.Errorf("BLKFLSBUF %s: %w", p, err)
			}
		}
		err = errors.Join(unix.Fdatasync(int(f.Fd())), unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("settle %s: %w", p, err)
		}
	}
	return nil
}

// ioKindNames are the kinds the bench knows, in the order of the report.
// squashfuse-ll (squashfuse_ll, the same package's daemon on libfuse's
// low-level API) is not in the default: -io-kinds names it.
var ioKindNames = []string{"loop-ext4", "loop-xfs", "chain", "squashfuse"}

// setupIO makes each kind's volume through the plugin's socket and publishes it at a
// target path, and makes its backing.
func (b *bench) setupIO(ctx context.Context) ([]*ioKind, error) {
	b.io = &ioState{dir: filepath.Join(b.dir, "io")}
	for _, name := range b.o.ioKinds {
		dir := filepath.Join(b.io.dir, name)
		k := &ioKind{volumeID: "mpbench-io-" + name, staging: filepath.Join(dir, "staging"), target: filepath.Join(dir, "publish", "target")}
		for _, d := range []string{k.staging, filepath.Dir(k.target), filepath.Join(dir, "raw")} {
			if err := os.MkdirAll(d, 0o750); err != nil {
				return nil, err
			}
		}
		b.io.kinds = append(b.io.kinds, k)
		b.logf("io: setting up %s", name)
		var err error
		switch name {
		case "loop-ext4", "loop-xfs":
			err = b.setupLoop(ctx, k, strings.TrimPrefix(name, "loop-"), dir)
		case "chain":
			err = b.setupChain(ctx, k, dir)
		case "squashfuse":
			err = b.setupSquashfuse(ctx, k, dir, "squashfuse", "squashfuse")
		case "squashfuse-ll":
			err = b.setupSquashfuse(ctx, k, dir, "squashfuse-ll", "squashfuse_ll")
		default:
			err = fmt.Errorf("no such kind %q (%s)", name, strings.Join(ioKindNames, ", "))
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	return b.io.kinds, nil
}

func ioCap(fsType string, readOnly bool) *csi.VolumeCapability {
	mode := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	if readOnly {
		mode = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	}
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// stagePublish stages k's volume and publishes it at k.target.
func (b *bench) stagePublish(ctx context.Context, k *ioKind, vcap *csi.VolumeCapability, vctx map[string]string) error {
	if _, err := b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: k.volumeID, StagingTargetPath: k.staging, VolumeCapability: vcap, VolumeContext: vctx}); err != nil {
		return fmt.Errorf("NodeStageVolume: %w", err)
	}
	k.staged = true
	if _, err := b.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: k.volumeID, StagingTargetPath: k.staging, TargetPath: k.target, VolumeCapability: vcap,
		VolumeContext: vctx, Readonly: k.readOnly}); err != nil {
		return fmt.Errorf("NodePublishVolume: %w", err)
	}
	k.pub = true
	return nil
}

// setupLoop provisions a volume of fsType twice the size of fio's file
// (xfs: at least 512 MiB), stages and publishes it; the backing is a file
// in the bench's dir, on the filesystem that holds the image.
func (b *bench) setupLoop(ctx context.Context, k *ioKind, fsType, dir string) error {
	k.name, k.direct = "loop "+fsType, true
	k.backing = "a file on the image's filesystem"
	vcap := ioCap(fsType, false)
	r, err := b.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               k.volumeID,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: max(2*b.o.ioSize, 512<<20)},
		VolumeCapabilities: []*csi.VolumeCapability{vcap},
		Parameters:         map[string]string{"fsType": fsType},
	})
	if err != nil {
		return fmt.Errorf("CreateVolume: %w", err)
	}
	k.volumeID, k.created = r.GetVolume().GetVolumeId(), true
	if err := b.stagePublish(ctx, k, vcap, nil); err != nil {
		return err
	}
	k.volFile, k.rawFile = filepath.Join(k.target, "mpbench.fio"), filepath.Join(dir, "raw", "mpbench.fio")
	return nil
}

// setupChain stages a static squashfs image with a writable overlay whose
// upper is a scratch ext4 image (upperSize: room for fio's files on both
// sides); the backing is a file on that upper filesystem, beside the
// overlay's upper and work directories (where the overlay never looks).
func (b *bench) setupChain(ctx context.Context, k *ioKind, dir string) error {
	k.name, k.direct = "chain (overlay on squashfs)", true
	k.backing = "a file on its upper's filesystem (scratch ext4 on loop)"
	src := filepath.Join(dir, "lower-src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "README"), []byte("the lower layer of mountplan's I/O bench\n"), 0o644); err != nil {
		return err
	}
	img := filepath.Join(b.imageRoot(), "chain-lower.sqfs")
	if err := runTool("mksquashfs", src, img, "-noappend", "-quiet", "-no-progress"); err != nil {
		return err
	}
	upper := 2*b.o.ioSize + 128<<20
	vctx := map[string]string{"type": "loop", "image": img, "overlay": "true", "upperSize": strconv.FormatInt(upper, 10)}
	if err := b.stagePublish(ctx, k, ioCap("", false), vctx); err != nil {
		return err
	}
	uppers, _ := filepath.Glob(filepath.Join(b.stateDir, "chains", "*", "upper"))
	if len(uppers) != 1 {
		return fmt.Errorf("want one chain upper under %s, found %v", b.stateDir, uppers)
	}
	raw := filepath.Join(uppers[0], "mpbench-raw")
	if err := os.MkdirAll(raw, 0o700); err != nil {
		return err
	}
	k.volFile, k.rawFile = filepath.Join(k.target, "mpbench.fio"), filepath.Join(raw, "mpbench.fio")
	return nil
}

// setupSquashfuse makes a squashfs image holding one file of random data
// (fio's size), stages it with profile, whose daemon is the command daemon
// (fd mode: it serves as nobody) and publishes it read-only; the
// backing is the same file through the kernel's squashfs of the same image.
func (b *bench) setupSquashfuse(ctx context.Context, k *ioKind, dir, profile, daemon string) error {
	k.name, k.readOnly, k.daemon = daemon, true, daemon
	k.backing = "the kernel's squashfs of the same image (mount -o loop)"
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	if err := fillImage(filepath.Join(src, "data"), b.o.ioSize); err != nil {
		return err
	}
	img := filepath.Join(b.imageRoot(), daemon+".sqfs")
	// Random data does not compress: store it as it is, which spares the
	// compressor's time at build and leaves both readers the same blocks.
	if err := runTool("mksquashfs", src, img, "-noappend", "-quiet", "-no-progress", "-noI", "-noD", "-noF", "-noX"); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(src, "data")); err != nil {
		return err
	}
	if err := os.Chmod(img, 0o644); err != nil { // the daemon runs as nobody
		return err
	}
	vctx := map[string]string{"type": "fuse", "profile": profile, "source": img}
	if err := b.stagePublish(ctx, k, ioCap("", true), vctx); err != nil {
		return err
	}
	k.kernelMount = filepath.Join(dir, "raw")
	if err := runTool("mount", "-t", "squashfs", "-o", "loop,ro,nodev,nosuid", img, k.kernelMount); err != nil {
		return err
	}
	dev, err := loopOf(img)
	if err != nil {
		return err
	}
	k.settle = []string{img, dev}
	k.volFile, k.rawFile = filepath.Join(k.target, "data"), filepath.Join(k.kernelMount, "data")
	return nil
}

// loopOf names the loop device whose backing file is img.
func loopOf(img string) (string, error) {
	for _, l := range loops() {
		if l.backing == img {
			return "/dev/" + l.name, nil
		}
	}
	return "", fmt.Errorf("no loop device backed by %s", img)
}

// imageRoot is the imageRoots entry of the bench's admin config.
func (b *bench) imageRoot() string { return filepath.Join(b.dir, "images") }

// squashRoot is the squashfuse profile's source root.
func (b *bench) squashRoot() string { return b.imageRoot() }

// writeIOConfig writes the admin config of the I/O benchmark: its image
// root, and the squashfuse profile of the examples with its source root
// there, and the same for squashfuse_ll. The dirs up to it must be
// searchable by nobody (the daemon).
func (b *bench) writeIOConfig() (string, error) {
	if err := os.MkdirAll(b.imageRoot(), 0o755); err != nil {
		return "", err
	}
	// MkdirTemp made the bench's dir 0700; its parent (-state-dir) must let
	// others through already.
	if err := os.Chmod(b.dir, 0o711); err != nil {
		return "", err
	}
	cfg := fmt.Sprintf(`imageRoots: [%q]
defaultFsType: ext4
fuseProfiles:
- name: squashfuse
  binary: /usr/bin/squashfuse
  args: [-f, "{source}", "{mountpoint}"]
  fdMount: true
  mountOptions: [allow_other]
  source: {roots: [%q]}
  readyTimeout: 10s
- name: squashfuse-ll
  binary: /usr/bin/squashfuse_ll
  args: [-f, "{source}", "{mountpoint}"]
  fdMount: true
  mountOptions: [allow_other]
  source: {roots: [%q]}
  readyTimeout: 10s
`, b.imageRoot(), b.squashRoot(), b.squashRoot())
	p := filepath.Join(b.dir, "config.yaml")
	return p, os.WriteFile(p, []byte(cfg), 0o644)
}

// undoIO unpublishes, unstages and deletes what the I/O benchmark made,
// and unmounts the kernel's squashfs.
func (b *bench) undoIO(ctx context.Context, errf func(string, ...any)) {
	if b.io == nil {
		return
	}
	for _, k := range slices.Backward(b.io.kinds) {
		if k.kernelMount != "" {
			if err := unix.Unmount(k.kernelMount, 0); err != nil && !errors.Is(err, unix.EINVAL) {
				errf("umount %s: %v", k.kernelMount, err)
			}
		}
		if b.conn == nil || b.plugin == nil || b.plugin.exited() {
			continue
		}
		if k.pub {
			if _, err := b.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: k.volumeID, TargetPath: k.target}); err != nil {
				errf("NodeUnpublishVolume %s: %v", k.volumeID, err)
			}
		}
		if k.staged || k.pub {
			if _, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: k.volumeID, StagingTargetPath: k.staging}); err != nil {
				errf("NodeUnstageVolume %s: %v", k.volumeID, err)
			}
		}
		if k.created {
			if _, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: k.volumeID}); err != nil {
				errf("DeleteVolume %s: %v", k.volumeID, err)
			}
		}
	}
}
