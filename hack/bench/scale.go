package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// Measurement 8: scale. The node is filled with staged and published
// volumes level by level (-scale, e.g. 10,100,1000,10000) by -scale-clients
// concurrent clients; at each level a handful of extra volumes (-scale-ops)
// go through every per-volume operation one after another, each timed, and
// so does the in-process floor cycle (attach, mount, umount, detach) for
// what the kernel itself costs at that many mounts. At the top level the
// plugin is restarted (ready time, RSS) and left idle with a short
// reconcile interval (its CPU time). Then the volumes are torn down
// (unpublish, unstage, delete) by the same clients, the first and the last
// 1,000 of them timed.

// scaleOps are the per-volume operations measured at each level, in the
// order an extra volume goes through them.
var scaleOps = []string{
	"CreateVolume", "NodeStageVolume", "NodePublishVolume", "NodePrepareVolume", "NodeGetVolumeStats",
	"NodeUnprepareVolume", "NodeUnpublishVolume", "NodeUnstageVolume", "DeleteVolume",
}

// scaleFloorOp names the in-process floor cycle timed beside them.
const scaleFloorOp = "floor cycle: attach, mount, umount, detach (direct syscalls)"

// teardownBatch is the goal's number of volumes torn down.
const teardownBatch = 1000

// scaleVol is one volume the scale measurement made; its flags say what
// the teardown must undo.
type scaleVol struct {
	id, staging, target string
	staged, published   bool
}

// scaleResult is what measurement 8 found; JSON as written.
type scaleResult struct {
	Levels  []int                              `json:"levels"`
	Clients int                                `json:"clients"`
	SizeMiB int                                `json:"volume_size_mib"`
	OpsMs   map[string]map[string][]float64    `json:"ops_ms"` // operation -> N -> every timed call
	FillS   map[string]float64                 `json:"fill_seconds"`
	Restart *restartResult                     `json:"restart,omitempty"`
	Down    []teardownResult                   `json:"teardown,omitempty"`
	ops     map[string]map[int][]time.Duration // the same, unrounded
	order   []string                           // the operations in the order first timed
}

type restartResult struct {
	Volumes           int     `json:"volumes"`
	Shape             string  `json:"shape"`
	ListeningMs       float64 `json:"listening_ms"` // exec to the socket accepting
	ReadyMs           float64 `json:"ready_ms"`     // exec to Probe ready (startup reconcile done)
	RSSMiB            float64 `json:"rss_mib"`      // the larger of VmRSS at ready and after the idle window
	HWMMiB            float64 `json:"hwm_mib"`      // VmHWM after the idle window
	ReconcileInterval string  `json:"reconcile_interval"`
	IdleSeconds       float64 `json:"idle_seconds"`
	IdleCPUPercent    float64 `json:"idle_cpu_percent_of_a_core"`
	// The mounter (split only), which the restart leaves running: its RSS
	// (the larger of VmRSS at the plugin's ready and after the idle
	// window), peak, and CPU over the same idle window.
	MounterRSSMiB         float64 `json:"mounter_rss_mib,omitempty"`
	MounterHWMMiB         float64 `json:"mounter_hwm_mib,omitempty"`
	MounterIdleCPUPercent float64 `json:"mounter_idle_cpu_percent_of_a_core,omitempty"`
}

type teardownResult struct {
	From, To int
	Seconds  float64 `json:"seconds"`
}

// scaleState is the volumes measurement 8 holds now, for its own
// teardown and for the bench's teardown on error or signal.
type scaleState struct {
	mu   sync.Mutex
	vols []*scaleVol
	seq  int
}

func (b *bench) measureScale(ctx context.Context, res *results) error {
	sr := &scaleResult{Levels: b.o.scaleLevels, Clients: b.o.scaleClients, SizeMiB: scaleSize >> 20,
		OpsMs: map[string]map[string][]float64{}, FillS: map[string]float64{}, ops: map[string]map[int][]time.Duration{}}
	res.scale = sr
	if err := os.MkdirAll(filepath.Join(b.dir, "scale"), 0o750); err != nil {
		return err
	}
	for _, n := range b.o.scaleLevels {
		have := b.scale.count()
		b.logf("measurement 8: filling from %d to %d volumes", have, n)
		t := time.Now()
		if err := b.fillTo(ctx, n); err != nil {
			return fmt.Errorf("fill to %d volumes: %w", n, err)
		}
		sr.FillS[strconv.Itoa(n)] = time.Since(t).Seconds()
		b.logf("measurement 8: %d volumes staged and published in %v; %d extra operations each", n, time.Since(t), b.o.scaleOps)
		m0, _ := b.scrape(ctx, b.instance)
		for i := 0; i < b.o.scaleOps; i++ {
			if err := b.extraVolume(ctx, sr, n, i); err != nil {
				return fmt.Errorf("at %d volumes, extra volume %d: %w", n, i, err)
			}
			fs := newSample(0, scaleFloorOp)
			if err := b.floorCycle(ctx, fs); err != nil {
				return fmt.Errorf("at %d volumes, floor cycle: %w", n, err)
			}
			sr.add(scaleFloorOp, n, fs.totals[0])
			for _, step := range fs.order { // attach and mount: the kernel's part of stage and publish
				sr.add("floor step: "+step, n, fs.steps[step][0])
			}
		}
		b.scaleInside(ctx, sr, n, m0)
	}
	top := b.scale.count()
	b.logf("measurement 8: restarting the plugin with %d volumes", top)
	rr, err := b.restartIdle(ctx, top)
	if err != nil {
		return fmt.Errorf("restart with %d volumes: %w", top, err)
	}
	sr.Restart = rr
	batch := min(teardownBatch, top)
	if top > batch {
		d, err := b.teardownScale(ctx, batch)
		if err != nil {
			return err
		}
		sr.Down = append(sr.Down, teardownResult{From: top, To: top - batch, Seconds: d.Seconds()})
		if _, err := b.teardownScale(ctx, b.scale.count()-batch); err != nil {
			return err
		}
	}
	from := b.scale.count()
	d, err := b.teardownScale(ctx, from)
	if err != nil {
		return err
	}
	sr.Down = append(sr.Down, teardownResult{From: from, To: 0, Seconds: d.Seconds()})
	for op, byN := range sr.ops {
		sr.OpsMs[op] = map[string][]float64{}
		for n, ds := range byN {
			for _, d := range ds {
				sr.OpsMs[op][strconv.Itoa(n)] = append(sr.OpsMs[op][strconv.Itoa(n)], msf(d))
			}
		}
	}
	return nil
}

// scaleInside records, for level n, what the plugin's own metrics say of
// its device steps during the extra operations (their means since m0), and
// a durable journal write's median: the parts of CreateVolume, stage and
// publish that might grow with the node.
func (b *bench) scaleInside(ctx context.Context, sr *scaleResult, n int, m0 map[string]hist) {
	if m1, err := b.scrape(ctx, b.instance); err == nil && m0 != nil {
		means := meansBetween(m0, m1)
		for _, step := range []string{"format", "attach", "mount"} {
			if d, ok := means["step:"+step]; ok {
				sr.add("in plugin: step "+step+" (mean, its metrics)", n, d)
			}
		}
	}
	if jw := b.measureJournalWrite(ctx); jw != nil {
		for _, name := range jw.order {
			if strings.HasPrefix(name, "durable") {
				sr.add("floor: journal record write, "+name, n, median(jw.steps[name]))
			}
		}
	}
}

func (sr *scaleResult) add(op string, n int, d time.Duration) {
	if sr.ops[op] == nil {
		sr.ops[op] = map[int][]time.Duration{}
		sr.order = append(sr.order, op)
	}
	sr.ops[op][n] = append(sr.ops[op][n], d)
}

func (s *scaleState) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.vols)
}

// newVol makes the staging dir and the target's parent of a new volume
// called name.
func (b *bench) newVol(name string) (*scaleVol, error) {
	d := filepath.Join(b.dir, "scale", name)
	v := &scaleVol{staging: filepath.Join(d, "staging"), target: filepath.Join(d, "publish", "target")}
	for _, p := range []string{v.staging, filepath.Dir(v.target)} {
		if err := os.MkdirAll(p, 0o750); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// fillTo creates, stages and publishes volumes until n are held.
func (b *bench) fillTo(ctx context.Context, n int) error {
	have := b.scale.count()
	if n <= have {
		return nil
	}
	return parallel(ctx, b.o.scaleClients, n-have, func(ctx context.Context, _ int) error {
		b.scale.mu.Lock()
		b.scale.seq++
		name := fmt.Sprintf("mpbench-scale-%d", b.scale.seq)
		b.scale.mu.Unlock()
		v, err := b.newVol(name)
		if err != nil {
			return err
		}
		return b.upVol(ctx, v, name, nil)
	})
}

// upVol creates, stages and publishes v; each step's time goes to rec
// when it is not nil. v is tracked from its creation on.
func (b *bench) upVol(ctx context.Context, v *scaleVol, name string, rec func(op string, d time.Duration)) error {
	timed := func(op string, fn func() error) error { return timedOp(rec, op, fn) }
	if err := timed("CreateVolume", func() error {
		r, err := b.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name,
			CapacityRange: &csi.CapacityRange{RequiredBytes: scaleSize}, VolumeCapabilities: []*csi.VolumeCapability{mountCap()}})
		if err == nil {
			v.id = r.GetVolume().GetVolumeId()
			b.scale.mu.Lock()
			b.scale.vols = append(b.scale.vols, v)
			b.scale.mu.Unlock()
		}
		return err
	}); err != nil {
		return err
	}
	if err := timed("NodeStageVolume", func() error {
		_, err := b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: mountCap()})
		v.staged = v.staged || err == nil
		return err
	}); err != nil {
		return err
	}
	return timed("NodePublishVolume", func() error {
		_, err := b.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
			TargetPath: v.target, VolumeCapability: mountCap()})
		v.published = v.published || err == nil
		return err
	})
}

// timedOp runs fn and, when it succeeds, gives its time to rec (if not
// nil) under the operation's first word.
func timedOp(rec func(op string, d time.Duration), op string, fn func() error) error {
	t := time.Now()
	if err := fn(); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	if rec != nil {
		name, _, _ := strings.Cut(op, " ")
		rec(name, time.Since(t))
	}
	return nil
}

// downVol unpublishes, unstages and deletes v and stops tracking it.
func (b *bench) downVol(ctx context.Context, v *scaleVol, rec func(op string, d time.Duration)) error {
	timed := func(op string, fn func() error) error { return timedOp(rec, op+" "+v.id, fn) }
	if v.published {
		if err := timed("NodeUnpublishVolume", func() error {
			_, err := b.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
			return err
		}); err != nil {
			return err
		}
		v.published = false
	}
	if v.staged {
		if err := timed("NodeUnstageVolume", func() error {
			_, err := b.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
			return err
		}); err != nil {
			return err
		}
		v.staged = false
	}
	if err := timed("DeleteVolume", func() error {
		_, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id})
		return err
	}); err != nil {
		return err
	}
	b.scale.mu.Lock()
	for i, x := range b.scale.vols {
		if x == v {
			b.scale.vols = append(b.scale.vols[:i], b.scale.vols[i+1:]...)
			break
		}
	}
	b.scale.mu.Unlock()
	return nil
}

// extraVolume takes one more volume through every per-volume operation at
// level n, timing each.
func (b *bench) extraVolume(ctx context.Context, sr *scaleResult, n, i int) error {
	name := fmt.Sprintf("mpbench-scale-x%d-%d", n, i)
	v, err := b.newVol(name)
	if err != nil {
		return err
	}
	rec := func(op string, d time.Duration) { sr.add(op, n, d) }
	if err := b.upVol(ctx, v, name, rec); err != nil {
		return err
	}
	cons := &api.Consumer{Pid: int64(b.consumer.pid()), MountPoint: b.consMount}
	t := time.Now()
	r, err := b.prep.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		VolumeCapability: mountCap(), Consumer: cons})
	if err != nil {
		return fmt.Errorf("NodePrepareVolume: %w", err)
	}
	rec("NodePrepareVolume", time.Since(t))
	cons.MntNsInode = r.GetConsumer().GetMntNsInode()
	t = time.Now()
	if _, err := b.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target}); err != nil {
		return fmt.Errorf("NodeGetVolumeStats: %w", err)
	}
	rec("NodeGetVolumeStats", time.Since(t))
	t = time.Now()
	if _, err := b.prep.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: v.id, Consumer: cons}); err != nil {
		return fmt.Errorf("NodeUnprepareVolume: %w", err)
	}
	rec("NodeUnprepareVolume", time.Since(t))
	return b.downVol(ctx, v, rec)
}

// teardownScale tears down the last k volumes held with the bench's
// clients and returns how long that took.
func (b *bench) teardownScale(ctx context.Context, k int) (time.Duration, error) {
	b.scale.mu.Lock()
	k = min(k, len(b.scale.vols))
	vols := append([]*scaleVol(nil), b.scale.vols[len(b.scale.vols)-k:]...)
	b.scale.mu.Unlock()
	b.logf("measurement 8: tearing down %d of %d volumes", k, b.scale.count())
	t := time.Now()
	err := parallel(ctx, b.o.scaleClients, k, func(ctx context.Context, i int) error { return b.downVol(ctx, vols[i], nil) })
	return time.Since(t), err
}

// restartIdle stops the plugin, starts it again on the same state dir with
// the scale reconcile interval, and measures how long it takes to answer,
// its RSS, and its CPU time over the idle window. Split, the mounter stays
// (the plugin's container restarts, not the mounter's): its RSS and CPU
// over the same window are measured too.
func (b *bench) restartIdle(ctx context.Context, volumes int) (*restartResult, error) {
	if b.conn != nil {
		_ = b.conn.Close()
		b.conn = nil
	}
	if err := b.plugin.stop(syscall.SIGTERM, 30*time.Second); err != nil {
		return nil, err
	}
	b.reconcileInterval = b.o.scaleReconcile.String()
	if err := b.startPlugin(ctx, b.instance); err != nil {
		return nil, err
	}
	b.node, b.ctrl, b.prep = csi.NewNodeClient(b.conn), csi.NewControllerClient(b.conn), api.NewNodePrepareClient(b.conn)
	rr := &restartResult{Volumes: volumes, Shape: b.instance.shape(), ListeningMs: msf(b.pluginListening), ReadyMs: msf(b.pluginReady),
		ReconcileInterval: b.reconcileInterval, IdleSeconds: b.o.scaleIdle.Seconds()}
	procs := []*child{b.plugin}
	if b.mounterProc != nil {
		procs = append(procs, b.mounterProc)
	}
	rss0, cpu0 := make([]int64, len(procs)), make([]time.Duration, len(procs))
	for i, c := range procs {
		var err error
		if rss0[i], _, err = procMem(c.pid()); err != nil {
			return nil, err
		}
		if cpu0[i], err = procCPU(c); err != nil {
			return nil, err
		}
	}
	t := time.Now()
	if err := sleepCtx(ctx, b.o.scaleIdle); err != nil {
		return nil, err
	}
	idle := time.Since(t)
	for i, c := range procs {
		cpu1, err := procCPU(c)
		if err != nil {
			return nil, err
		}
		rss1, hwm, err := procMem(c.pid())
		if err != nil {
			return nil, err
		}
		cpu := 100 * float64(cpu1-cpu0[i]) / float64(idle)
		rss, peak := float64(max(rss0[i], rss1))/(1<<20), float64(hwm)/(1<<20)
		if i == 0 {
			rr.IdleCPUPercent, rr.RSSMiB, rr.HWMMiB = cpu, rss, peak
		} else {
			rr.MounterIdleCPUPercent, rr.MounterRSSMiB, rr.MounterHWMMiB = cpu, rss, peak
		}
	}
	return rr, nil
}

// procMem reads VmRSS and VmHWM of pid, in bytes.
func procMem(pid int) (rss, hwm int64, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, l := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/%d/status: %s: %w", pid, l, err)
		}
		if k == "VmRSS" {
			rss = kb << 10
		} else {
			hwm = kb << 10
		}
	}
	return rss, hwm, nil
}

// parallel runs fn(0..n-1) on at most clients goroutines and returns the
// first error; after one, no new call starts.
func parallel(ctx context.Context, clients, n int, fn func(context.Context, int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for range min(clients, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := fn(ctx, i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					next.Store(int64(n)) // no new calls
					return
				}
			}
		}()
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// teardownScaleAll is the bench teardown's part for measurement 8: every
// volume still held, whatever state it reached.
func (b *bench) teardownScaleAll(ctx context.Context) error {
	b.scale.mu.Lock()
	vols := append([]*scaleVol(nil), b.scale.vols...)
	b.scale.mu.Unlock()
	if len(vols) == 0 {
		return nil
	}
	var mu sync.Mutex
	var errs []error
	_ = parallel(ctx, max(b.o.scaleClients, 1), len(vols), func(ctx context.Context, i int) error {
		if err := b.downVol(ctx, vols[i], nil); err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		return nil // go on with the others
	})
	if len(errs) > 3 {
		errs = append(errs[:3], fmt.Errorf("and %d more", len(errs)-3))
	}
	return errors.Join(errs...)
}

// parseLevels parses -scale: increasing volume counts.
func parseLevels(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || (len(out) > 0 && n <= out[len(out)-1]) {
			return nil, fmt.Errorf("-scale: %q: want increasing counts of at least 1, e.g. 10,100,1000,10000", s)
		}
		out = append(out, n)
	}
	return out, nil
}
