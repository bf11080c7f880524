package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// runIO is the I/O benchmark's run (-io): the main instance (the plugin
// beside its mounter, as deployed, with the I/O benchmark's admin config),
// the kinds' volumes, fio, the table and the JSON, the teardown and its
// leak check. It returns the exit code.
func runIO(ctx context.Context, o options) int {
	o.phases = map[int]bool{} // the main instance only
	b, err := newBench(o)
	if err == nil {
		b.instance.config, err = b.writeIOConfig()
	}
	if err == nil {
		err = b.startInstance(ctx, b.instance)
		defer func() { b.journal.close(); b.records.close() }()
	}
	var res []*ioResult
	if err == nil {
		res, err = b.measureIO(ctx)
	}
	if b == nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	b.sayFailure(ctx, err)
	env := describeEnv(b.dir) + "; " + accelNote()
	if len(res) > 0 {
		printIO(os.Stdout, o, env, res)
	}
	if err == nil {
		if file, serr := saveIO(o, env, res, time.Now()); serr != nil {
			fmt.Fprintln(os.Stderr, "bench:", serr)
		} else {
			fmt.Printf("\nwritten: %s\n", file)
		}
	}
	return b.finish(ctx, err)
}

// accelNote says whether this machine is a guest: the figures of a VM's
// disk are its host's and its hypervisor's.
func accelNote() string {
	data, _ := os.ReadFile("/proc/cpuinfo")
	if strings.Contains(string(data), " hypervisor") {
		return "a virtual machine"
	}
	return "bare metal"
}

// printIO prints one markdown table: for each kind and workload, the
// volume's and the backing's IOPS, MB/s and latency, the ratio of their
// IOPS, and the CPU time per I/O of the processes serving the volume.
func printIO(w io.Writer, o options, env string, res []*ioResult) {
	fmt.Fprintf(w, "## mountplan bench-io: fio on each volume kind as published, against its backing\n\n")
	fmt.Fprintf(w, "%s. fio %s jobs of %d s, %d rounds, targets in turn; file %d MiB; ioengine libaio. "+
		"Latency: completion latency, the mean of the rounds' percentiles. CPU per I/O: the plugin, the mounter "+
		"(mountplan-sidecar serve) and the daemon serving the volume, from /proc/PID/stat, and fio's own.\n\n",
		env, fioVersion(), o.ioRuntime, o.ioRounds, o.ioSize>>20)
	fmt.Fprintln(w, "| kind | workload | IOPS | MB/s | p50 µs | p99 µs | backing IOPS | backing MB/s | backing p50 µs | backing p99 µs | ratio | CPU µs/IO plugin / mounter / daemon | fio CPU µs/IO vol / backing |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range res {
		v, b := r.Volume, r.Raw
		fmt.Fprintf(w, "| %s | %s | %.0f | %.1f | %.0f | %.0f | %.0f | %.1f | %.0f | %.0f | %.2f× | %.1f / %.1f / %.1f | %.1f / %.1f |\n",
			r.Kind, r.Workload.Name, v.IOPS, v.MBps, v.P50us, v.P99us, b.IOPS, b.MBps, b.P50us, b.P99us, r.Ratio,
			v.PluginCPUus, v.MounterCPUus, v.DaemonCPUus, v.FioCPUus, b.FioCPUus)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Backings:")
	seen := map[string]bool{}
	for _, r := range res {
		if !seen[r.Kind] {
			seen[r.Kind] = true
			mode := "O_DIRECT"
			if !r.Direct {
				mode = "buffered, one pass over the file per job, every read cold (fio drops the file's cache, the bench the image's and its loop device's, before each job)"
			}
			fmt.Fprintf(w, "- %s: %s; %s\n", r.Kind, r.Backing, mode)
		}
	}
}

func fioVersion() string {
	out, err := exec.Command("fio", "--version").Output()
	if err != nil {
		return "fio"
	}
	return strings.TrimSpace(string(out))
}

// saveIO writes the run's figures as JSON under -out.
func saveIO(o options, env string, res []*ioResult, now time.Time) (string, error) {
	if err := os.MkdirAll(o.outDir, 0o755); err != nil {
		return "", err
	}
	rep := struct {
		Time    time.Time   `json:"time"`
		Env     string      `json:"env"`
		Fio     string      `json:"fio"`
		Runtime int         `json:"runtime_s"`
		Rounds  int         `json:"rounds"`
		SizeMiB int64       `json:"file_mib"`
		Results []*ioResult `json:"results"`
	}{now.UTC(), env, fioVersion(), o.ioRuntime, o.ioRounds, o.ioSize >> 20, res}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return "", err
	}
	p := filepath.Join(o.outDir, "bench-io-"+now.UTC().Format("20060102T150405Z")+".json")
	return p, os.WriteFile(p, append(js, '\n'), 0o644)
}
