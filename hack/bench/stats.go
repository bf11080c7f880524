package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// sample holds the timed iterations of one measurement.
type sample struct {
	n      int // measurement number, 0 for a reference
	name   string
	in     *instance // the instance of a socket cycle; nil for a floor
	order  []string
	steps  map[string][]time.Duration
	writes map[string][]int // the plugin's volume records
	// recWrites are the mounter's record writes (its loops and mounts).
	recWrites map[string][]int
	// asides are steps left out of the cycle's total.
	asides map[string]bool
	totals []time.Duration
	// pluginCPU and mounterCPU are the CPU time (user + system) of the
	// instance's plugin and mounter process per timed cycle.
	pluginCPU, mounterCPU time.Duration
	// inPlugin are the means of the plugin's own histograms over the timed
	// cycles: "rpc:<method>" and "step:<device step>".
	inPlugin map[string]time.Duration
	// mounterCalls are the calls to the mounter in each step of one
	// untimed cycle (nil: not counted).
	mounterCalls map[string]int
	// windows, when not nil, receives every step of the cycles recorded
	// (countMounterCalls).
	windows *[]stepTime
}

func newSample(n int, name string) *sample {
	return &sample{n: n, name: name, steps: map[string][]time.Duration{}, writes: map[string][]int{},
		recWrites: map[string][]int{}, asides: map[string]bool{}}
}

func (s *sample) add(step string, d time.Duration) {
	if _, ok := s.steps[step]; !ok {
		s.order = append(s.order, step)
	}
	s.steps[step] = append(s.steps[step], d)
}

func (s *sample) addWrites(step string, w, rw int) {
	s.writes[step] = append(s.writes[step], w)
	s.recWrites[step] = append(s.recWrites[step], rw)
}

func (s *sample) addTotal(d time.Duration) { s.totals = append(s.totals, d) }

// median is the middle value (the mean of the two middle ones for an even
// count); p90 is the nearest-rank 90th percentile.
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func p90(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(0.9*float64(len(s)))) - 1
	return s[max(i, 0)]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }

func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f×", float64(a)/float64(b))
}

// writesOf summarises the journal writes a step made per call.
func writesOf(ws []int) string {
	if len(ws) == 0 {
		return "–"
	}
	lo, hi := slices.Min(ws), slices.Max(ws)
	if lo == hi {
		return fmt.Sprint(lo)
	}
	return fmt.Sprintf("%d–%d", lo, hi)
}

type results struct {
	o            options
	env          string
	shape        string // the main instance's label
	before       string // the -compare instance's label, "" without
	samples      []*sample
	journalWrite *sample
	noopRPC      *sample
	mounterRPC   *sample // nil without a mounter process
	straces      []string
	dataPath     []dataResult
	scale        *scaleResult
	nri          *nriResult
}

func (r *results) byN(n int) *sample {
	for _, s := range r.samples {
		if s.n == n {
			return s
		}
	}
	return nil
}

// floorOf names the floor each measurement is compared with.
var floorOf = map[int]int{1: 2, 3: 2, 4: 5, nAlonePublish: 2, nBeforePublish: 2, nAlonePrepare: 5, nLeanPublish: 2, nLeanPrepare: 5}

// leanOf names the lean server's cycle each plugin's cycle is compared
// with, step by step.
var leanOf = map[int]int{1: nLeanPublish, nAlonePublish: nLeanPublish, nBeforePublish: nLeanPublish, 4: nLeanPrepare, nAlonePrepare: nLeanPrepare}

// leanGap is the median of a plugin's step less the median of the lean
// server's step that does the same (leanStep), "–" when there is none.
func (r *results) leanGap(s *sample, step string) string {
	l := r.byN(leanOf[s.n])
	if l == nil || s.asides[step] {
		return "–"
	}
	ds, ok := l.steps[leanStep(step)]
	if !ok {
		return "–"
	}
	return fmt.Sprintf("%+.2f ms", msf(median(s.steps[step])-median(ds)))
}

func (r *results) print(w io.Writer) {
	if len(r.samples) == 0 && len(r.dataPath) == 0 && r.scale == nil && r.nri == nil {
		return
	}
	fmt.Fprintf(w, "## mountplan bench: 64 MiB ext4 loop volume, %d timed iterations after %d warm-ups\n\n", r.o.n, r.o.warmup)
	fmt.Fprintf(w, "%s\n\n", r.env)
	fmt.Fprintf(w, "Measured: %s", r.shape)
	var others []string
	for _, s := range r.samples {
		if s.in != nil && s.in.label != r.shape && !slices.Contains(others, s.in.label) {
			others = append(others, s.in.label)
		}
	}
	if len(others) > 0 {
		fmt.Fprintf(w, "; taking turns with it, each with a state dir and volume of its own: %s", strings.Join(others, "; "))
	}
	fmt.Fprint(w, ".\n\n")
	printSummary(w, r.summary())
	if len(r.samples) == 0 { // only measurements 7, 8 and 9 ran
		r.printDataPath(w)
		r.scale.print(w)
		r.nri.print(w)
		return
	}
	if r.before != "" && r.byN(4) != nil {
		fmt.Fprintf(w, "\nThe prepare cycle of %s is not measured: its plan names a loop device its own plugin attached, and the mounter of this build "+
			"performs only plans of devices it set up itself (the executor of that commit, which checked nothing of the kind, is not in this build).\n", r.before)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Each measurement")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| # | cycle | median | p90 | vs floor (median) | vs floor (p90) |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|")
	for _, s := range r.samples {
		vsMed, vsP90 := "–", "–"
		if s.n == 2 || s.n == 5 {
			vsMed, vsP90 = "floor", "floor"
		}
		if f, ok := floorOf[s.n]; ok {
			vsMed, vsP90 = "–", "–"
			if fs := r.byN(f); fs != nil {
				vsMed = ratio(median(s.totals), median(fs.totals)) + " of #" + fmt.Sprint(f)
				vsP90 = ratio(p90(s.totals), p90(fs.totals)) + " of #" + fmt.Sprint(f)
			}
		}
		fmt.Fprintf(w, "| %d | %s | %s | %s | %s | %s |\n", s.n, s.name, ms(median(s.totals)), ms(p90(s.totals)), vsMed, vsP90)
	}

	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Per step (each RPC timed separately at the client)")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Journal writes are the plugin's volume records, mounter record writes the mounter's records of its loop devices and mounts "+
		"(for a plugin alone, those of its mounter in process); mounter calls are counted in one untimed cycle (strace of the plugin, "+
		"plus the bench's own calls).")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "The lean server's cycles (#13, #14) do each step's system calls only; a plugin's step less the lean server's same step "+
		"(the plan performed in process for #14) is what the plugin adds to it.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| # | step | median | p90 | share of cycle median | − lean's (median) | journal writes per call | mounter record writes per call | mounter calls | in plugin handler (mean, its metrics) |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, s := range r.samples {
		tot := median(s.totals)
		for _, step := range s.order {
			ds := s.steps[step]
			share := "–"
			switch {
			case s.asides[step]:
				share = "not in the total"
			case tot > 0:
				share = fmt.Sprintf("%.0f%%", 100*float64(median(ds))/float64(tot))
			}
			wr, rw, calls, in := "–", "–", "–", "–"
			if s.in != nil {
				if strings.HasPrefix(step, "Node") {
					if s.in.journal != nil { // the lean server has none
						wr = writesOf(s.writes[step])
					}
					if d, ok := s.inPlugin["rpc:"+step]; ok {
						in = ms(d)
					}
				}
				if s.in.records != nil {
					rw = writesOf(s.recWrites[step])
				}
				if c, ok := s.mounterCalls[step]; ok {
					calls = fmt.Sprint(c)
				}
			}
			fmt.Fprintf(w, "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s.n, step, ms(median(ds)), ms(p90(ds)), share, r.leanGap(s, step), wr, rw, calls, in)
		}
	}
	r.printAttribution(w)
	r.printDataPath(w)
	r.scale.print(w)
	r.nri.print(w)
	for _, t := range r.straces {
		fmt.Fprintf(w, "\n### strace -f -c -w of the plugin during the timed loop of %s\n", t)
	}
}

// refMedian is the median of a reference sample's only step.
func refMedian(s *sample) time.Duration {
	if s == nil || len(s.order) == 0 {
		return 0
	}
	return median(s.steps[s.order[0]])
}

// rpcSteps are the steps of a cycle that are calls over the socket.
func rpcSteps(s *sample) int {
	n := 0
	for _, step := range s.order {
		if strings.HasPrefix(step, "Node") {
			n++
		}
	}
	return n
}

// mounterCallCount is the number of calls to the mounter in one cycle of
// s (counted once), 0 when not counted.
func mounterCallCount(s *sample) int {
	n := 0
	for step, c := range s.mounterCalls {
		if !s.asides[step] {
			n += c
		}
	}
	return n
}

// socketSamples are the samples of socket cycles, in the order run.
func (r *results) socketSamples() []*sample {
	var out []*sample
	for _, s := range r.samples {
		if s.in != nil {
			out = append(out, s)
		}
	}
	return out
}

// printAttribution splits each socket cycle's median into the kernel work
// (its floor's median), the journal writes (count x the median of one
// write), the bare cost of its RPCs (count x a no-op RPC), of its calls to
// the mounter (count x a mounter call that does nothing), and the rest.
// Medians do not add exactly: this is an estimate, not an accounting.
func (r *results) printAttribution(w io.Writer) {
	jw, rpc, mrpc := refMedian(r.journalWrite), refMedian(r.noopRPC), refMedian(r.mounterRPC)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "### Where the cycle time goes (estimate from medians)")
	fmt.Fprintln(w)
	if jw > 0 {
		for _, name := range r.journalWrite.order {
			fmt.Fprintf(w, "- one journal record write, %s: median %s, p90 %s\n",
				name, ms(median(r.journalWrite.steps[name])), ms(p90(r.journalWrite.steps[name])))
		}
	}
	if rpc > 0 {
		fmt.Fprintf(w, "- one no-op RPC over the socket (Identity.GetPluginInfo): median %s, p90 %s\n",
			ms(rpc), ms(p90(r.noopRPC.steps[r.noopRPC.order[0]])))
	}
	if mrpc > 0 {
		fmt.Fprintf(w, "- one call to the mounter that does nothing (internal/unixrpc, LiveNamespaces of a consumer without namespace, from the bench): median %s, p90 %s\n",
			ms(mrpc), ms(p90(r.mounterRPC.steps[r.mounterRPC.order[0]])))
	}
	for _, s := range r.socketSamples() {
		if s.pluginCPU > 0 || s.mounterCPU > 0 {
			line := fmt.Sprintf("- CPU time (user + system, /proc/PID/stat) per cycle %d (%s): plugin %s", s.n, s.in.label, ms(s.pluginCPU))
			if s.in.mounterProc != nil {
				line += fmt.Sprintf(", mounter %s", ms(s.mounterCPU))
			}
			fmt.Fprintln(w, line)
		}
	}
	for _, s := range r.socketSamples() {
		var parts []string
		for k, d := range s.inPlugin {
			if step, ok := strings.CutPrefix(k, "step:"); ok {
				parts = append(parts, step+" "+ms(d))
			}
		}
		if len(parts) > 0 {
			slices.Sort(parts)
			fmt.Fprintf(w, "- device steps inside the plugin during cycle %d (mean, its step_duration_seconds): %s\n", s.n, strings.Join(parts, ", "))
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| # | cycle median | kernel work (floor median) | journal writes | RPC round trips | mounter calls | rest (plugin, mounter and client code, scheduling) |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|")
	for _, s := range r.socketSamples() {
		f := r.byN(floorOf[s.n])
		tot := median(s.totals)
		pct := func(d time.Duration) string {
			return fmt.Sprintf("%s (%.0f%%)", ms(d), 100*float64(d)/float64(tot))
		}
		var kernel time.Duration
		kernelCell := "– (floor not run)"
		if f != nil {
			kernel = median(f.totals)
			kernelCell = pct(kernel)
		}
		writes := 0
		for _, step := range s.order {
			if ws := s.writes[step]; len(ws) > 0 && !s.asides[step] {
				writes += slices.Max(ws)
			}
		}
		jt := time.Duration(writes) * jw
		calls := rpcSteps(s)
		rt := time.Duration(calls) * rpc
		mcalls := mounterCallCount(s)
		mt := time.Duration(mcalls) * mrpc
		mcell := "–"
		if s.mounterCalls != nil && mrpc > 0 {
			mcell = fmt.Sprintf("%d × = %s", mcalls, pct(mt))
		}
		rest := tot - kernel - jt - rt - mt
		fmt.Fprintf(w, "| %d | %s | %s | %d × = %s | %d × = %s | %s | %s |\n", s.n, ms(tot), kernelCell, writes, pct(jt), calls, pct(rt), mcell, pct(rest))
	}
}

// writeCounter counts record writes (renames into, in-place rewrites of,
// and deletions from the directories watched: <state-dir>/volumes, the
// mounter's loops and mounts) with inotify. It watches opens
// and creations too: inotify merges an event into an identical unread one,
// and an open (or a durable write's temp file) between two writes of the
// same record keeps them apart. A nil counter counts nothing.
type writeCounter struct{ fd int }

func newWriteCounter(dirs ...string) (*writeCounter, error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	for _, dir := range dirs {
		if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE|unix.IN_OPEN|unix.IN_CLOSE_WRITE|unix.IN_MOVED_TO|unix.IN_DELETE); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("inotify_add_watch %s: %w", dir, err)
		}
	}
	return &writeCounter{fd: fd}, nil
}

// drain returns the number of record writes and deletions since the last
// drain.
func (w *writeCounter) drain() int {
	if w == nil {
		return 0
	}
	n := 0
	buf := make([]byte, 64*1024)
	for {
		k, err := unix.Read(w.fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || k <= 0 {
			return n
		}
		for off := 0; off+unix.SizeofInotifyEvent <= k; {
			// struct inotify_event: wd, mask, cookie, len, name[len]
			mask := binary.NativeEndian.Uint32(buf[off+4:])
			nameLen := int(binary.NativeEndian.Uint32(buf[off+12:]))
			name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:min(k, off+unix.SizeofInotifyEvent+nameLen)]), "\x00")
			if mask&(unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE|unix.IN_DELETE) != 0 && !strings.HasPrefix(name, ".") {
				n++
			}
			off += unix.SizeofInotifyEvent + nameLen
		}
	}
}

func (w *writeCounter) close() {
	if w != nil {
		unix.Close(w.fd)
	}
}
