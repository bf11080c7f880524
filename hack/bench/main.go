// Command bench measures what a volume cycle costs through mountplan-plugin's
// socket against the kernel work that cycle asks for, on a 64 MiB ext4 loop
// volume, in the deployment's shape: the plugin reaches its mounter
// (`mountplan-sidecar serve`, every privileged act) with --mounter-endpoint
// over internal/unixrpc. With -alone the plugin runs alone, its mounter in
// process, as before the split.
//
//  1. publish cycle through the socket: NodeStageVolume, NodePublishVolume,
//     NodeUnpublishVolume, NodeUnstageVolume against the real plugin binary;
//     with -hop (the default when split) the same binary alone and with
//     -compare a second plugin binary alone (e.g. the commit before the
//     split) take turns with it, each with a state dir and volume of its
//     own, and the summary compares them; with -lean a lean CSI node server
//     (hack/bench/leancsi: the same four RPCs over grpc-go on a unix socket,
//     each doing only its system calls, state in memory) takes turns too,
//     with an image and socket of its own: the floor plus the transport
//     kubelet imposes, against which the plugin's own cost is held to 1.2×
//     (issue 23);
//
//  2. its floor, in process: loopdev.Attach (a loop number it detached
//     before, else LOOP_CTL_GET_FREE; LOOP_CONFIGURE), mount(2)
//     nosuid,nodev, umount2, detach;
//
//  3. the same with util-linux: losetup --find --show, mount, umount,
//     losetup -d;
//
//  4. prepare cycle through the socket: NodeStageVolume, NodePrepareVolume,
//     the returned plan performed in a consumer's mount namespace by the
//     mounter that attached the device (split: its socket, as the
//     sidecar's mount command or the NRI hook; alone: a mounter.Local
//     observing the plugin's records, as `mountplan-sidecar mount`), its
//     Unmount, NodeUnprepareVolume, NodeUnstageVolume; with -hop the same
//     binary alone takes turns with it; with -lean the lean server's
//     stage, prepare (the plan of its device, from memory), unprepare and
//     unstage, the plan performed in process as measurement 5 does it;
//
//  5. its floor: attach, fsopen/fsmount (mountns.Build), setns into the
//     consumer (mountns.OpenPID + Do), move_mount (mountns.Attach), umount
//     inside the namespace, detach.
//
//  6. fresh volumes, one after another: CreateVolume, the first stage, a
//     later stage of the same volume, DeleteVolume;
//
//  7. the data path: O_DIRECT 1 MiB reads and writes at queue depth 1 and
//     16 on a backing file and through loop devices bound to it with and
//     without direct I/O, with 512-byte and the filesystem's block size;
//
//  8. scale (not run unless asked for: minutes at 10,000 volumes): the
//     node filled with staged and published volumes level by level
//     (-scale), every per-volume operation of a few extra volumes and the
//     floor cycle timed at each level; at the top level a restart of the
//     plugin (ready time, RSS; the mounter's RSS beside it) and their idle
//     CPU time; then the teardown by -scale-clients concurrent clients,
//     the first and the last 1,000 volumes timed (scale.go);
//
//  9. the NRI hook's cost per container: BenchmarkContainerStart (test/nri)
//     run and read (nrihook.go): container start latency through a private
//     containerd with and without the hook, and the hook's CreateContainer
//     and StartContainer from the sidecar's log, against a handler that
//     makes one call to the lean server's NodePrepareVolume at each.
//
// A socket cycle and its floor (1 and 2, 4 and 5) run in turn, cycle by
// cycle, so that load drifts hit both alike.
//
// It prints one summary table (operation, p50, p99, ratio, goal, met or
// not) and writes the same figures as JSON with an SVG plot of every
// cycle's latency under -out; then markdown tables of medians and p90s,
// the median of every step (each RPC separately) with the journal and
// mounter record writes each RPC made and its calls to the mounter, so that
// time above the floor can be attributed.
//
// Everything it makes lives in one temporary directory and is removed at the
// end, on error and on SIGINT/SIGTERM: the plugins and then the mounters are
// stopped, the consumer process killed, loop devices detached and mounts
// removed. The last line is a leak check of loop devices backed by files
// under that directory, of mounts under it, and of the processes the bench
// started and theirs (tool spawners).
//
// Run it as root: hack/bench.sh [-n 50] [-state-dir /var/tmp].
//
// With -io it runs the I/O benchmark instead (make bench-io,
// hack/bench-io.sh; io.go): fio on every volume kind as published through
// the plugin beside its mounter, against its backing, in turn.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func init() {
	// Children (plugin, consumer) are started from the main goroutine with
	// Pdeathsig, which the kernel ties to the starting *thread*. mountns.Do
	// ends the threads it enters namespaces on; pinning the main goroutine
	// to the main thread (which Do never uses) keeps the children alive.
	runtime.LockOSThread()
}

type options struct {
	n, warmup int
	baseDir   string
	plugin    string
	sidecar   string // the mounter: mountplan-sidecar serve beside the plugin
	alone     bool   // the plugin alone, its mounter in process (no sidecar)
	hop       bool   // split: the current build alone takes turns too
	compare   string // a second plugin binary, alone, taking turns
	lean      string // the lean CSI node server (hack/bench/leancsi), taking turns; "" for none
	// compareLabel names it in the reports (default: its VCS revision,
	// else its file name).
	compareLabel string
	phases       map[int]bool
	straceOut    string
	verbose      bool
	mounts       int
	outDir       string
	// The data path measurement (7): seconds of I/O in all, in rounds.
	dataSeconds float64
	dataRounds  int
	// The I/O benchmark (-io, make bench-io): fio on every kind.
	io        bool
	ioRuntime int // seconds per fio job
	ioRounds  int
	ioSize    int64 // bytes of fio's file
	ioKinds   []string
	// The scale measurement (8).
	scaleLevels    []int
	scaleOps       int
	scaleClients   int
	scaleIdle      time.Duration
	scaleReconcile time.Duration
}

func main() {
	var o options
	var phases, levels, ioKinds, ioSize string
	flag.IntVar(&o.n, "n", 50, "timed iterations of each cycle")
	flag.IntVar(&o.warmup, "warmup", 5, "untimed iterations before the timed ones")
	flag.StringVar(&o.baseDir, "state-dir", "/var/tmp", "directory under which a fresh temporary dir is made for the plugin's state dir, the images, the socket and the mount points")
	flag.StringVar(&o.plugin, "plugin", "bin/mountplan-plugin", "plugin binary")
	flag.StringVar(&o.sidecar, "sidecar", "bin/mountplan-sidecar", "mounter binary: `mountplan-sidecar serve` runs beside the plugin (--mounter-endpoint), as deployed, unless -alone")
	flag.BoolVar(&o.alone, "alone", false, "run the plugin alone with its mounter in process (no --mounter-endpoint), the shape before the split")
	flag.BoolVar(&o.hop, "hop", true, "unless -alone: the same plugin binary also runs alone (mounter in process, a state dir and volume of its own) and its publish and prepare cycles take turns with measurements 1 and 4, so that the cost of the hop to the mounter shows")
	flag.StringVar(&o.compareLabel, "compare-label", "", "what -compare's binary is called in the reports, e.g. its commit (default: the VCS revision stamped in it, else its file name)")
	flag.StringVar(&o.compare, "compare", "", "a second plugin `binary` (e.g. built from the commit before the split), run alone with a state dir and volume of its own: its publish cycle takes turns with measurement 1's and the floor's, and the summary compares the two (the issue's goal: not slower by more than 10%)")
	flag.StringVar(&o.lean, "lean", "bin/mpbench-leancsi", "the lean CSI node server `binary` (hack/bench/leancsi; hack/bench.sh builds it), which takes turns in measurements 1 and 4 with an image and socket of its own; empty: none")
	flag.StringVar(&phases, "phases", "1,2,3,4,5,6,7,9", "which measurements to run (1 publish cycle, 2 floor, 3 util-linux, 4 prepare cycle, 5 prepare floor, 6 fresh volumes: create, first and later stage, delete, 7 data path: O_DIRECT 1 MiB I/O on the backing file and through loop devices, 8 scale: every per-volume operation at -scale staged and published volumes, restart, idle CPU, teardown; not in the default, 9 NRI hook: BenchmarkContainerStart of test/nri run and read, the hook's time per container against its lean equivalent, about 30 s; it needs a private containerd 2 with CRI and NRI, which hack/tools/build.sh builds, crictl and runc)")
	flag.StringVar(&levels, "scale", "10,100,1000,10000", "measurement 8: the numbers of staged and published volumes at which operations are timed, increasing")
	flag.IntVar(&o.scaleOps, "scale-ops", 45, "measurement 8: extra volumes taken through every operation at each level (with 15, p50s of sub-millisecond operations moved by 0.7-1.5× from run to run)")
	flag.IntVar(&o.scaleClients, "scale-clients", 8, "measurement 8: concurrent clients filling the node and tearing it down")
	flag.DurationVar(&o.scaleIdle, "scale-idle", 65*time.Second, "measurement 8: how long the restarted plugin's CPU time is measured while idle (longer than -scale-reconcile, so that it holds a periodic reconcile)")
	flag.DurationVar(&o.scaleReconcile, "scale-reconcile", time.Minute, "measurement 8: --reconcile-interval of the restarted plugin (the plugin's default is 1m)")
	flag.Float64Var(&o.dataSeconds, "data-seconds", 40, "measurement 7: seconds of I/O in all, shared by every target, direction and queue depth")
	flag.IntVar(&o.dataRounds, "data-rounds", 4, "measurement 7: rounds in which the targets take turns")
	flag.BoolVar(&o.io, "io", false, "run the I/O benchmark instead of the measurements (make bench-io, hack/bench-io.sh): fio against every volume kind of -io-kinds as published through the plugin beside its mounter, and against its backing, in turn, round after round")
	flag.IntVar(&o.ioRuntime, "io-runtime", 5, "-io: seconds of each fio job")
	flag.IntVar(&o.ioRounds, "io-rounds", 2, "-io: rounds in which the targets take turns")
	flag.StringVar(&ioSize, "io-size", "256M", "-io: size of fio's file on each target (K, M, G suffixes)")
	flag.StringVar(&ioKinds, "io-kinds", strings.Join(ioKindNames, ","), "-io: the volume kinds, in order")
	flag.StringVar(&o.outDir, "out", "bench-results", "directory for the JSON and SVG of the run (made if missing)")
	flag.StringVar(&o.straceOut, "strace", "", "if set, attach `strace -f -c -w` (wall-clock time per syscall) to the plugin during the timed loops of cycles 1 and 4 and write its summaries to FILE.cycle1 and FILE.cycle4 (timings are then perturbed)")
	flag.BoolVar(&o.verbose, "v", false, "log progress to stderr")
	flag.IntVar(&o.mounts, "mounts", 0, "run everything in a private mount namespace holding this many extra tmpfs mounts, as a busy node's mount table would (the host's table is not touched)")
	flag.Parse()
	var err error
	o.ioKinds = strings.Split(ioKinds, ",")
	if o.ioSize, err = parseSize(ioSize); err != nil || o.ioSize < 16<<20 || o.ioRuntime < 1 || o.ioRounds < 1 {
		fail(fmt.Errorf("-io-size must be at least 16M, -io-runtime and -io-rounds at least 1 (-io-size: %v)", err))
	}
	if o.phases, err = parsePhases(phases); err != nil {
		fail(err)
	}
	if o.scaleLevels, err = parseLevels(levels); err != nil {
		fail(err)
	}
	if o.scaleOps < 1 || o.scaleClients < 1 || o.scaleIdle <= 0 || o.scaleReconcile <= 0 {
		fail(errors.New("-scale-ops, -scale-clients, -scale-idle and -scale-reconcile must be positive"))
	}
	if o.n < 1 || o.warmup < 0 || o.dataRounds < 1 || o.dataSeconds <= 0 {
		fail(errors.New("-n, -data-rounds and -data-seconds must be at least 1 and -warmup at least 0"))
	}
	if os.Geteuid() != 0 {
		fail(errors.New("needs root: loop devices, mounts and mount namespaces"))
	}
	for _, p := range []*string{&o.plugin, &o.sidecar, &o.compare, &o.lean} {
		if *p == "" {
			continue
		}
		if *p, err = filepath.Abs(*p); err != nil {
			fail(err)
		}
	}
	bins := []string{o.plugin}
	if !o.alone {
		bins = append(bins, o.sidecar)
	}
	if o.compare != "" {
		bins = append(bins, o.compare)
	}
	if o.lean != "" && (o.phases[1] || o.phases[4]) && !o.io {
		bins = append(bins, o.lean)
	}
	for _, p := range bins {
		if st, err := os.Stat(p); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			fail(fmt.Errorf("%s: no executable there (make build; hack/bench.sh builds the lean server)", p))
		}
	}
	if o.mounts > 0 && os.Getenv(inNamespaceEnv) == "" {
		os.Exit(reexecInNamespace())
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	if o.io {
		if _, err := exec.LookPath("fio"); err != nil {
			fail(fmt.Errorf("-io needs fio (Debian's package fio; hack/install-deps.sh --bench): %w", err))
		}
		os.Exit(runIO(ctx, o))
	}
	code := run(ctx, o)
	os.Exit(code)
}

// inNamespaceEnv marks the copy of the bench that -mounts started in a
// private mount namespace.
const inNamespaceEnv = "MPBENCH_IN_PRIVATE_MOUNT_NS"

// reexecInNamespace runs this command again under `unshare -m
// --propagation private`, so that the extra mounts of -mounts never appear
// in the host's table, and returns its exit code.
func reexecInNamespace() int {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP) // the child handles them and tears down
	exe, err := os.Executable()
	if err != nil {
		fail(err)
	}
	cmd := exec.Command("unshare", append([]string{"-m", "--propagation", "private", exe}, os.Args[1:]...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), inNamespaceEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		fail(err)
	}
	return 0
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(2)
}

// parseSize reads a byte count with an optional K, M or G suffix (powers
// of 1024).
func parseSize(s string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, strings.TrimSuffix(s, "G")
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	return n * mult, nil
}

func parsePhases(s string) (map[int]bool, error) {
	m := map[int]bool{}
	for _, f := range strings.Split(s, ",") {
		var p int
		if _, err := fmt.Sscanf(strings.TrimSpace(f), "%d", &p); err != nil || p < 1 || p > 9 {
			return nil, fmt.Errorf("-phases: %q is not one of 1..9", f)
		}
		m[p] = true
	}
	return m, nil
}

// run does the whole benchmark and returns the exit code. Teardown runs
// whatever happened before it.
func run(ctx context.Context, o options) int {
	b, err := newBench(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		if b != nil {
			fmt.Println(b.teardown())
		}
		return 1
	}
	res, runErr := b.measure(ctx)
	b.sayFailure(ctx, runErr)
	if res != nil {
		res.print(os.Stdout)
		if runErr == nil {
			if files, err := res.save(o.outDir, time.Now()); err != nil {
				fmt.Fprintln(os.Stderr, "bench:", err)
			} else {
				fmt.Printf("\nwritten: %s\n", strings.Join(files, ", "))
			}
		}
	}
	return b.finish(ctx, runErr)
}

// sayFailure tells on stderr why a measurement stopped, with the tails of
// the plugin's and mounter's logs, which usually hold the reason.
func (b *bench) sayFailure(ctx context.Context, err error) {
	switch {
	case err != nil && ctx.Err() != nil:
		fmt.Fprintln(os.Stderr, "bench: interrupted; tearing down")
	case err != nil:
		fmt.Fprintln(os.Stderr, "bench:", err)
		if tail := b.logTails(30); tail != "" {
			fmt.Fprintln(os.Stderr, tail)
		}
	}
}

// finish tears everything down, prints the leak check and returns the
// exit code: 130 when interrupted, 1 when the run failed, 3 when it
// leaked, 0 otherwise.
func (b *bench) finish(ctx context.Context, runErr error) int {
	leaks := b.teardown()
	fmt.Println()
	fmt.Println(leaks)
	switch {
	case ctx.Err() != nil:
		return 130
	case runErr != nil:
		return 1
	case !leaks.clean():
		return 3
	}
	return 0
}

func (b *bench) logf(format string, args ...any) {
	if b.o.verbose {
		fmt.Fprintf(os.Stderr, "%s bench: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
	}
}
