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
	order  []string
	steps  map[string][]time.Duration
	writes map[string][]int
	totals []time.Duration
	// pluginCPU is the plugin's CPU time (user + system) per timed cycle.
	pluginCPU time.Duration
	// inPlugin are the means of the plugin's own histograms over the timed
	// cycles: "rpc:<method>" and "step:<device step>".
	inPlugin map[string]time.Duration
}

func newSample(n int, name string) *sample {
	return &sample{n: n, name: name, steps: map[string][]time.Duration{}, writes: map[string][]int{}}
}

func (s *sample) add(step string, d time.Duration) {
	if _, ok := s.steps[step]; !ok {
		s.order = append(s.order, step)
	}
	s.steps[step] = append(s.steps[step], d)
}

func (s *sample) addWrites(step string, w int) { s.writes[step] = append(s.writes[step], w) }

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
	samples      []*sample
	journalWrite *sample
	noopRPC      *sample
	straces      []string
	dataPath     []dataResult
	scale        *scaleResult
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
var floorOf = map[int]int{1: 2, 3: 2, 4: 5}

func (r *results) print(w io.Writer) {
	if len(r.samples) == 0 && len(r.dataPath) == 0 && r.scale == nil {
		return
	}
	fmt.Fprintf(w, "## mountplan bench: 64 MiB ext4 loop volume, %d timed iterations after %d warm-ups\n\n", r.o.n, r.o.warmup)
	fmt.Fprintf(w, "%s\n\n", r.env)
	printSummary(w, r.summary())
	if len(r.samples) == 0 { // only measurements 7 and 8 ran
		r.printDataPath(w)
		r.scale.print(w)
		return
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
	fmt.Fprintln(w, "| # | step | median | p90 | share of cycle median | journal writes per call | in plugin handler (mean, its metrics) |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|")
	for _, s := range r.samples {
		tot := median(s.totals)
		for _, step := range s.order {
			ds := s.steps[step]
			share := "–"
			if tot > 0 {
				share = fmt.Sprintf("%.0f%%", 100*float64(median(ds))/float64(tot))
			}
			wr, in := "–", "–"
			if (s.n == 1 || s.n == 4) && strings.HasPrefix(step, "Node") {
				wr = writesOf(s.writes[step])
				if d, ok := s.inPlugin["rpc:"+step]; ok {
					in = ms(d)
				}
			}
			fmt.Fprintf(w, "| %d | %s | %s | %s | %s | %s | %s |\n", s.n, step, ms(median(ds)), ms(p90(ds)), share, wr, in)
		}
	}
	r.printAttribution(w)
	r.printDataPath(w)
	r.scale.print(w)
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

// printAttribution splits each socket cycle's median into the kernel work
// (its floor's median), the journal writes (count x the median of one
// write), the bare cost of its RPCs (count x a no-op RPC), and the rest.
// Medians do not add exactly: this is an estimate, not an accounting.
func (r *results) printAttribution(w io.Writer) {
	jw, rpc := refMedian(r.journalWrite), refMedian(r.noopRPC)
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
	for _, n := range []int{1, 4} {
		if s := r.byN(n); s != nil && s.pluginCPU > 0 {
			fmt.Fprintf(w, "- plugin CPU time (user + system, /proc/PID/stat) per cycle %d: %s\n", n, ms(s.pluginCPU))
		}
	}
	for _, n := range []int{1, 4} {
		s := r.byN(n)
		if s == nil {
			continue
		}
		var parts []string
		for k, d := range s.inPlugin {
			if step, ok := strings.CutPrefix(k, "step:"); ok {
				parts = append(parts, step+" "+ms(d))
			}
		}
		if len(parts) > 0 {
			slices.Sort(parts)
			fmt.Fprintf(w, "- device steps inside the plugin during cycle %d (mean, its step_duration_seconds): %s\n", n, strings.Join(parts, ", "))
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| # | cycle median | kernel work (floor median) | journal writes | RPC round trips | rest (plugin and client code, scheduling) |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|")
	for _, n := range []int{1, 4} {
		s, f := r.byN(n), r.byN(floorOf[n])
		if s == nil {
			continue
		}
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
			if ws := s.writes[step]; len(ws) > 0 {
				writes += slices.Max(ws)
			}
		}
		jt := time.Duration(writes) * jw
		calls := rpcSteps(s)
		rt := time.Duration(calls) * rpc
		rest := tot - kernel - jt - rt
		fmt.Fprintf(w, "| %d | %s | %s | %d × = %s | %d × = %s | %s |\n", n, ms(tot), kernelCell, writes, pct(jt), calls, pct(rt), pct(rest))
	}
}

// writeCounter counts journal writes (renames into, in-place rewrites of,
// and deletions from <state-dir>/volumes) with inotify. It watches opens
// and creations too: inotify merges an event into an identical unread one,
// and an open (or a durable write's temp file) between two writes of the
// same record keeps them apart. A nil counter counts nothing.
type writeCounter struct{ fd int }

func newWriteCounter(dir string) (*writeCounter, error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE|unix.IN_OPEN|unix.IN_CLOSE_WRITE|unix.IN_MOVED_TO|unix.IN_DELETE); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("inotify_add_watch %s: %w", dir, err)
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
