package unixrpc_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/unixrpc"
)

// serverEnv names the socket a child of the test binary serves on
// (TestMain): the benchmark's server in a process of its own, as
// the mounter is beside the plugin.
const serverEnv = "UNIXRPC_BENCH_SOCKET"

type statReq struct {
	Path string `json:"path"`
}

type statResp struct {
	Dev uint64 `json:"dev"`
	Ino uint64 `json:"ino"`
}

// benchServer registers Noop; Stat, a handler that makes one syscall as
// the mounter's handlers do; and Block, one that blocks 1 ms in a
// syscall as a mount(2) or umount2(2) of the publish cycle does (the Go
// runtime then hands the thread's P off, and the answer has to wake a
// thread of each process).
func benchServer() *unixrpc.Server {
	s := unixrpc.NewServer(klog.Background())
	unixrpc.Handle(s, "Noop", func(context.Context, statReq, []*os.File) (statResp, error) {
		return statResp{}, nil
	})
	unixrpc.Handle(s, "Stat", func(_ context.Context, r statReq, _ []*os.File) (statResp, error) {
		var st syscall.Stat_t
		if err := syscall.Stat(r.Path, &st); err != nil {
			return statResp{}, err
		}
		return statResp{Dev: st.Dev, Ino: st.Ino}, nil
	})
	unixrpc.Handle(s, "Block", func(context.Context, statReq, []*os.File) (statResp, error) {
		ts := syscall.Timespec{Nsec: int64(time.Millisecond)}
		for {
			// The runtime's preemption signal interrupts the sleep:
			// it goes on with what is left.
			err := syscall.Nanosleep(&ts, &ts)
			if err != syscall.EINTR {
				return statResp{}, err
			}
		}
	})
	return s
}

// TestMain runs the benchmark's server process instead of the tests when
// BenchmarkCall started this binary as one (serverEnv names its socket):
// it serves until its parent closes its stdin.
func TestMain(m *testing.M) {
	path := os.Getenv(serverEnv)
	if path == "" {
		os.Exit(m.Run())
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	go func() {
		_, _ = os.Stdin.Read(make([]byte, 1))
		stop()
	}()
	if err := benchServer().Serve(ctx, l); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// startServerProcess runs the server (TestMain) in a child, waits for its
// socket and returns its process ID.
func startServerProcess(b *testing.B, path string) int {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), serverEnv+"="+path)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return cmd.Process.Pid
		}
		if time.Now().After(deadline) {
			b.Fatal("the server process did not start")
		}
	}
}

// BenchmarkCall measures one round trip of a small request on a pooled
// connection (the plugin's cost per call to the mounter), with the server
// in another process (child/) and in this one (same/), for a handler that
// does nothing and one that stats a path, with a deadline on the
// caller's context (as kubelet gives every CSI call) and without one
// (none/, as the bench's calls). Besides the time of a call it reports
// the CPU time both processes spent on it (cpu-ns/op) and how often one
// of their threads went to sleep (sleeps/op: voluntary context switches,
// each ended by a wake-up): wake-ups of idle threads cost CPU and, on a
// loaded node, latency, even where they are off a call's path. The least
// is two: the server sleeps after its answer, the client while it waits
// for it.
func BenchmarkCall(b *testing.B) {
	for _, where := range []string{"child", "same"} {
		for _, method := range []string{"Noop", "Stat", "Block"} {
			for _, deadline := range []string{"deadline", "none"} {
				b.Run(where+"/"+method+"/"+deadline, func(b *testing.B) {
					benchCall(b, where, method, deadline == "deadline")
				})
			}
		}
	}
}

func benchCall(b *testing.B, where, method string, deadline bool) {
	path := filepath.Join(b.TempDir(), "rpc.sock")
	pids := []int{os.Getpid()}
	if where == "child" {
		pids = append(pids, startServerProcess(b, path))
	} else {
		serveBench(b, path)
	}
	c := unixrpc.NewClient(path)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	if deadline {
		ctx, cancel = context.WithTimeout(context.Background(), time.Hour)
	}
	defer cancel()
	req := statReq{Path: path}
	cpu, sleeps := cpuTime(b, pids), sleepCount(b, pids)
	for b.Loop() {
		if _, err := unixrpc.Call[statReq, statResp](ctx, c, method, req); err != nil {
			b.Fatal(err)
		}
	}
	cpu, sleeps = cpuTime(b, pids)-cpu, sleepCount(b, pids)-sleeps
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(sleeps)/float64(b.N), "sleeps/op")
}

func serveBench(b *testing.B, path string) {
	l, err := net.Listen("unix", path)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- benchServer().Serve(ctx, l) }()
	b.Cleanup(func() {
		cancel()
		<-done
	})
}

// cpuTime is the CPU time (user and system) the processes pids have used
// so far, from /proc/PID/stat (in ticks of 10 ms: a benchmark's second
// makes it precise to 1%).
func cpuTime(b *testing.B, pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			b.Fatal(err)
		}
		// The fields after the command's closing parenthesis: state is
		// the first, utime and stime the 12th and 13th.
		f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
		for _, s := range f[11:13] {
			ticks, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			total += time.Duration(ticks) * 10 * time.Millisecond
		}
	}
	return total
}

// sleepCount is how often the threads of the processes pids went to sleep
// so far: the sum of their voluntary context switches (a thread that
// exited is no longer counted; the Go runtime keeps its threads).
func sleepCount(b *testing.B, pids []int) int64 {
	var total int64
	for _, pid := range pids {
		tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
		if err != nil {
			b.Fatal(err)
		}
		for _, task := range tasks {
			data, err := os.ReadFile(task)
			if err != nil {
				continue // the thread exited
			}
			for _, line := range strings.Split(string(data), "\n") {
				if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
					n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					if err != nil {
						b.Fatal(err)
					}
					total += n
				}
			}
		}
	}
	return total
}
