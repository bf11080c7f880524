package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// countMounterCalls runs one untimed cycle of fn with strace attached to
// in's plugin and counts, for each step, the calls the plugin made to its
// mounter (internal/unixrpc sends a request with one sendmsg, and nothing else
// in the plugin calls sendmsg: gRPC writes with write) plus those the bench
// made itself (a prepare cycle's mount and unmount). nil when strace is
// missing or the cycle fails.
func (b *bench) countMounterCalls(ctx context.Context, in *instance, fn func(context.Context, *sample) error) map[string]int {
	if _, err := exec.LookPath("strace"); err != nil {
		b.logf("not counting mounter calls: %v", err)
		return nil
	}
	out := filepath.Join(b.dir, "mounter-calls.strace")
	defer os.Remove(out)
	c, err := startChild("strace", nil, nil, "strace", "-f", "-qq", "-ttt", "-e", "trace=sendmsg", "-e", "signal=none",
		"-o", out, "-p", strconv.Itoa(in.plugin.pid()))
	if err != nil {
		b.logf("not counting mounter calls: %v", err)
		return nil
	}
	time.Sleep(300 * time.Millisecond) // let it attach to every thread
	var windows []stepTime
	cal := newSample(0, "mounter calls")
	cal.windows = &windows
	err = fn(ctx, cal)
	_ = c.stop(syscall.SIGINT, 10*time.Second)
	if err != nil {
		b.logf("not counting mounter calls: the cycle under strace: %v", err)
		return nil
	}
	data, err := os.ReadFile(out)
	if err != nil {
		b.logf("not counting mounter calls: %v", err)
		return nil
	}
	counts := map[string]int{}
	for _, w := range windows {
		counts[w.name] += w.benchCalls
	}
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.Contains(line, "sendmsg(") || strings.Contains(line, "resumed>") {
			continue
		}
		t, ok := straceTime(line)
		if !ok {
			continue
		}
		for _, w := range windows {
			if !t.Before(w.start) && !t.After(w.start.Add(w.d)) {
				counts[w.name]++
				break
			}
		}
	}
	return counts
}

// straceTime reads the -ttt timestamp (seconds.microseconds) of a line of
// strace -f output ("PID SECONDS.MICROS syscall(...)").
func straceTime(line string) (time.Time, bool) {
	for _, f := range strings.Fields(line)[:min(2, len(strings.Fields(line)))] {
		sec, frac, ok := strings.Cut(f, ".")
		if !ok {
			continue
		}
		s, err1 := strconv.ParseInt(sec, 10, 64)
		us, err2 := strconv.ParseInt(frac, 10, 64)
		if err1 != nil || err2 != nil || len(frac) != 6 {
			continue
		}
		return time.Unix(s, us*1000), true
	}
	return time.Time{}, false
}
