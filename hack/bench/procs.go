package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// child is a process the bench started and must end.
type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // from Wait, valid once done is closed
}

// startChild starts argv in its own process group, so that a terminal's
// SIGINT reaches the bench only and the teardown stays orderly, with
// Pdeathsig so that nothing outlives a SIGKILLed bench.
func startChild(name string, stdout, stderr *os.File, argv ...string) (*child, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { c.err = cmd.Wait(); close(c.done) }()
	return c, nil
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop sends sig, waits up to grace, then SIGKILLs. It reports how the
// process ended when that was not a clean exit on sig.
func (c *child) stop(sig syscall.Signal, grace time.Duration) error {
	if c == nil {
		return nil
	}
	if !c.exited() {
		_ = c.cmd.Process.Signal(sig)
	}
	select {
	case <-c.done:
	case <-time.After(grace):
		_ = c.cmd.Process.Kill()
		<-c.done
		return fmt.Errorf("%s ignored %v for %v; killed it", c.name, sig, grace)
	}
	if sig == syscall.SIGKILL {
		return nil
	}
	if c.err != nil {
		return fmt.Errorf("%s: %w", c.name, c.err)
	}
	return nil
}

// startPlugin starts in's plugin on its socket with its state dir (and its
// mounter's socket, split) and waits until Probe says ready (the startup
// reconcile has finished).
func (b *bench) startPlugin(ctx context.Context, in *instance) error {
	logf, err := os.OpenFile(in.pluginLog, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	// A long reconcile interval keeps the periodic reconcile out of the
	// timed loops; the startup reconcile still runs.
	interval := in.reconcileInterval
	if interval == "" {
		interval = "1h"
	}
	args := []string{in.binary,
		"--endpoint", "unix://" + in.sock, "--state-dir", in.stateDir, "--kubelet-dir", b.dir, "--node-id", "bench-node",
		"--reconcile-interval", interval}
	if in.split {
		args = append(args, "--mounter-endpoint", "unix://"+in.mounterSock)
	}
	args = append(args, in.configArgs()...)
	if in.metricsAddr = metricsAddress(in.binary); in.metricsAddr != "" {
		args = append(args, "--metrics-address", in.metricsAddr)
	}
	start := time.Now()
	in.plugin, err = startChild("plugin", logf, logf, args...)
	if err != nil {
		return err
	}
	b.logf("plugin pid %d, log %s", in.plugin.pid(), in.pluginLog)
	return waitServing(ctx, in, start)
}

// startLean starts the lean CSI node server on in's socket and waits until
// Probe says ready.
func (b *bench) startLean(ctx context.Context, in *instance) error {
	logf, err := os.OpenFile(in.pluginLog, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	start := time.Now()
	if in.plugin, err = startChild("lean server", logf, logf, in.binary, "--endpoint", "unix://"+in.sock); err != nil {
		return err
	}
	b.logf("lean server pid %d, log %s", in.plugin.pid(), in.pluginLog)
	return waitServing(ctx, in, start)
}

// waitServing waits until in's plugin, started at start, accepts
// connections on its socket, connects a client and waits until Probe says
// ready.
func waitServing(ctx context.Context, in *instance, start time.Time) (err error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if in.plugin.exited() {
			return fmt.Errorf("plugin (%s) exited at start: %v", in.label, in.plugin.err)
		}
		if c, err := net.DialTimeout("unix", in.sock, time.Second); err == nil {
			in.pluginListening = time.Since(start)
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("plugin (%s) socket did not accept connections within 30s", in.label)
		}
		if err := sleepCtx(ctx, time.Millisecond); err != nil {
			return err
		}
	}
	in.conn, err = grpc.NewClient("unix://"+in.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	id := csi.NewIdentityClient(in.conn)
	for {
		r, err := id.Probe(ctx, &csi.ProbeRequest{})
		if err == nil && r.GetReady().GetValue() {
			in.pluginReady = time.Since(start)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("plugin (%s) not ready within 30s (last probe: %v)", in.label, err)
		}
		if err := sleepCtx(ctx, time.Millisecond); err != nil {
			return err
		}
	}
}

// logTails returns the last n lines of every instance's logs.
func (b *bench) logTails(n int) string {
	if b == nil || b.instance == nil {
		return ""
	}
	var out []string
	for _, in := range b.instances() {
		if t := in.logTails(n); t != "" {
			out = append(out, t)
		}
	}
	return strings.Join(out, "\n")
}

func logTail(path string, n int) string {
	if path == "" {
		return ""
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// startConsumer starts `unshare -m --propagation private sleep infinity`
// and waits until its process is sleep in a mount namespace of its own.
func (b *bench) startConsumer(ctx context.Context) error {
	var err error
	b.consumer, err = startChild("consumer (unshare)", nil, os.Stderr,
		"unshare", "-m", "--propagation", "private", "sleep", "infinity")
	if err != nil {
		return err
	}
	self, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	pid := strconv.Itoa(b.consumer.pid())
	deadline := time.Now().Add(5 * time.Second)
	for {
		if b.consumer.exited() {
			return fmt.Errorf("unshare exited early: %v", b.consumer.err)
		}
		ns, _ := os.Readlink("/proc/" + pid + "/ns/mnt")
		comm, _ := os.ReadFile("/proc/" + pid + "/comm")
		if ns != "" && ns != self && string(bytes.TrimSpace(comm)) == "sleep" {
			b.logf("consumer pid %s in %s", pid, ns)
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("unshare did not enter a new mount namespace within 5s")
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			return err
		}
	}
}

// straceOn attaches `strace -f -c -w` to in's plugin and, split, to its
// mounter, one strace each so that their summaries stay apart (out and
// out.mounter); the returned function stops them and returns the summaries.
func (b *bench) straceOn(in *instance, out string) (func() string, error) {
	if _, err := exec.LookPath("strace"); err != nil {
		return nil, err
	}
	type traced struct {
		label, out string
		c          *child
	}
	procs := []*child{in.plugin}
	if in.mounterProc != nil {
		procs = append(procs, in.mounterProc)
	}
	var ts []traced
	stop := func() string {
		var sb strings.Builder
		for _, t := range ts {
			_ = t.c.stop(syscall.SIGINT, 10*time.Second)
			data, _ := os.ReadFile(t.out)
			fmt.Fprintf(&sb, "%s:\n%s\n", t.label, data)
		}
		return sb.String()
	}
	for i, p := range procs {
		t := traced{label: "plugin", out: out}
		if i > 0 {
			t.label, t.out = "mounter", out+".mounter"
		}
		c, err := startChild("strace", nil, nil, "strace", "-f", "-c", "-w", "-o", t.out, "-p", strconv.Itoa(p.pid()))
		if err != nil {
			stop()
			return nil, err
		}
		t.c = c
		ts = append(ts, t)
	}
	time.Sleep(300 * time.Millisecond) // let it attach to every thread
	return stop, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
