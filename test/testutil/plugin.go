package testutil

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Plugin is a mountplan-plugin process started by StartPlugin.
type Plugin struct {
	Binary   string
	Args     []string // every argument it is started with
	Endpoint string   // unix:///…/csi.sock, for CSI clients and the sidecar
	Socket   string   // the socket's path
	StateDir string
	Dir      string // a short temporary directory holding the socket, the state dir and the log
	LogPath  string // its stdout and stderr, across restarts
	// Cgroup, when set, is a cgroup directory (cgroup v1 or v2) that every
	// start moves the process into, right after starting it and before it
	// listens: a "container" of its own (see StartPluginInCgroup).
	Cgroup string

	t       testing.TB
	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	starts  int
}

// StartPlugin starts binary (see BuildBinaries) with
//
//	--endpoint unix://DIR/csi.sock --state-dir DIR/state --node-id test-node --kubelet-dir $TMPDIR
//
// followed by args (any of those four flags in args replaces the default),
// and waits until the socket accepts connections (for at most 30s). DIR is
// a fresh short directory under os.TempDir(), registered as a leak marker.
// Its stdout and stderr go to LogPath, whose tail is logged when the test
// fails. A cleanup stops it (see Stop), fails the test if it did not exit
// cleanly, and removes DIR.
func StartPlugin(t testing.TB, binary string, args ...string) *Plugin {
	t.Helper()
	return StartPluginInCgroup(t, binary, "", args...)
}

// StartPluginInCgroup is StartPlugin with the process (and every restart
// of it) moved into cgroup, a cgroup directory the caller made, right
// after it starts. "" means the test's own cgroup.
func StartPluginInCgroup(t testing.TB, binary, cgroup string, args ...string) *Plugin {
	t.Helper()
	dir := MarkedTempDir(t, "mpplug-")
	p := &Plugin{
		Binary:  binary,
		Dir:     dir,
		LogPath: filepath.Join(dir, "plugin.log"),
		Cgroup:  cgroup,
		t:       t,
	}
	var full []string
	if v, ok := flagValue(args, "endpoint"); ok {
		p.Endpoint = v
	} else {
		p.Endpoint = "unix://" + filepath.Join(dir, "csi.sock")
		full = append(full, "--endpoint", p.Endpoint)
	}
	p.Socket = strings.TrimPrefix(p.Endpoint, "unix://")
	if v, ok := flagValue(args, "state-dir"); ok {
		p.StateDir = v
	} else {
		p.StateDir = filepath.Join(dir, "state")
		full = append(full, "--state-dir", p.StateDir)
	}
	if _, ok := flagValue(args, "node-id"); !ok {
		full = append(full, "--node-id", "test-node")
	}
	if _, ok := flagValue(args, "kubelet-dir"); !ok {
		// Tests make their staging and target paths under the temp dir.
		full = append(full, "--kubelet-dir", os.TempDir())
	}
	p.Args = append(full, args...)

	t.Cleanup(func() {
		if err := p.Stop(); err != nil {
			t.Errorf("plugin: %v", err)
		}
		if t.Failed() {
			t.Logf("plugin log (%s), last lines:\n%s", p.LogPath, tailFile(p.LogPath, 50))
		}
		if err := removeAllNoMounts(dir); err != nil {
			t.Errorf("plugin: %v", err)
		}
	})
	p.start()
	return p
}

// flagValue finds --name VALUE, --name=VALUE, -name VALUE or -name=VALUE.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		for _, prefix := range []string{"--" + name, "-" + name} {
			if a == prefix && i+1 < len(args) {
				return args[i+1], true
			}
			if v, ok := strings.CutPrefix(a, prefix+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

func (p *Plugin) start() {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.starts++
	logf, err := os.OpenFile(p.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		p.t.Fatal(err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== start %d: %s %s\n", p.starts, p.Binary, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Binary, p.Args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("starting plugin: %v", err)
	}
	if p.Cgroup != "" {
		if err := JoinCgroup(p.Cgroup, cmd.Process.Pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			p.t.Fatalf("moving the plugin into %s: %v", p.Cgroup, err)
		}
	}
	done := make(chan struct{})
	p.cmd, p.done = cmd, done
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		p.waitErr = err
		p.mu.Unlock()
		close(done)
	}()

	var lastErr error
	up := Poll(30*time.Second, 10*time.Millisecond, func() bool {
		if closed(done) {
			return true
		}
		conn, err := net.DialTimeout("unix", p.Socket, time.Second)
		if err != nil {
			lastErr = err
			return false
		}
		conn.Close()
		return true
	})
	select {
	case <-done:
		p.t.Fatalf("plugin exited at start (%v); processes holding its socket: %v; log:\n%s", cmd.ProcessState, SocketHolders(p.Socket), tailFile(p.LogPath, 50))
	default:
	}
	if !up {
		p.t.Fatalf("plugin socket %s did not accept connections within 30s: %v; log:\n%s", p.Socket, lastErr, tailFile(p.LogPath, 50))
	}
}

func (p *Plugin) current() (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// PID returns the PID of the running plugin process (or of the last one).
func (p *Plugin) PID() int {
	cmd, _ := p.current()
	return cmd.Process.Pid
}

// Running reports whether the plugin process is still running.
func (p *Plugin) Running() bool {
	_, done := p.current()
	return !closed(done)
}

// Exited waits up to timeout for the plugin process to end (killed from
// elsewhere, e.g. with its cgroup, or crashed) and reports whether it did.
// A kill is not an exit until the process is reaped: check this, not
// Running, right after killing it.
func (p *Plugin) Exited(timeout time.Duration) bool {
	_, done := p.current()
	select {
	case <-done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Stop sends SIGTERM and waits for the plugin to exit, SIGKILLing it after
// 10s. It returns an error unless the plugin exited with status 0 on
// SIGTERM. Stopping a plugin that is not running returns nil.
func (p *Plugin) Stop() error {
	cmd, done := p.current()
	if closed(done) {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		return errors.New("plugin ignored SIGTERM for 10s; killed it")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waitErr != nil {
		return fmt.Errorf("plugin did not exit cleanly on SIGTERM: %w", p.waitErr)
	}
	return nil
}

// Kill9 kills the plugin with SIGKILL, as a crash would, and waits until it
// is gone. Its socket file stays behind.
func (p *Plugin) Kill9() {
	cmd, done := p.current()
	_ = cmd.Process.Kill()
	<-done
}

// Restart stops the plugin if it runs (failing the test unless it stops
// cleanly), starts it again with the same arguments and state directory,
// and waits until its socket accepts connections.
func (p *Plugin) Restart() {
	p.t.Helper()
	if err := p.Stop(); err != nil {
		p.t.Errorf("restarting plugin: %v", err)
	}
	p.start()
}

// Log returns everything the plugin wrote to stdout and stderr so far.
func (p *Plugin) Log() string {
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// JoinCgroup moves pid into the cgroup directory cg (cgroup.procs).
func JoinCgroup(cg string, pid int) error {
	return os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
}
