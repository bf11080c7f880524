// Package nbdtest starts real NBD servers (nbdkit's file plugin) for tests,
// on the host's loopback and inside the VM test's guest alike.
package nbdtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/testenv"
)

// Server is an nbdkit serving every file in Dir as an export of its name.
type Server struct {
	Dir     string // the exports
	Address string // 127.0.0.1:PORT (empty for a unix socket server)
	Socket  string // the unix socket (empty for a TCP server)
	Port    int
	cmd     *exec.Cmd
	done    chan struct{}
}

// Options tune StartNbdkit.
type Options struct {
	// Unix serves on a unix socket at this path instead of TCP.
	Unix string
	// TLSDir, when set, makes the server require TLS with the GnuTLS
	// layout in that directory (ca-cert.pem, server-cert.pem, server-key.pem).
	TLSDir string
	// ReadOnly serves the exports read-only.
	ReadOnly bool
	// Port, when set, is the TCP port to serve on (a server started again
	// where clients knew it); 0: a free one.
	Port int
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// AddExport creates a sparse export file of size bytes named name in dir.
func AddExport(t testing.TB, dir, name string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}

// StartNbdkit serves the files of dir. It skips the test when nbdkit is not
// installed, and stops the server in a cleanup (it also dies with the test
// process: --exit-with-parent).
func StartNbdkit(t testing.TB, dir string, o Options) *Server {
	t.Helper()
	testenv.RequireCommands(t, "nbdkit")
	var lastErr error
	for range 3 {
		s := &Server{Dir: dir, Socket: o.Unix}
		args := []string{"--foreground", "--exit-with-parent", "--log=stderr"}
		if o.Unix != "" {
			args = append(args, "--unix", o.Unix)
		} else {
			s.Port = o.Port
			if s.Port == 0 {
				s.Port = FreePort(t)
			}
			s.Address = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port))
			args = append(args, "--ipaddr", "127.0.0.1", "--port", strconv.Itoa(s.Port))
		}
		if o.TLSDir != "" {
			args = append(args, "--tls=require", "--tls-certificates="+o.TLSDir)
		}
		if o.ReadOnly {
			args = append(args, "--readonly")
		}
		pidfile := filepath.Join(dir, ".nbdkit.pid")
		_ = os.Remove(pidfile)
		args = append(args, "--pidfile", pidfile, "file", "dir="+dir)
		logf, err := os.Create(filepath.Join(os.TempDir(), fmt.Sprintf("nbdkit-%d.log", time.Now().UnixNano())))
		if err != nil {
			t.Fatal(err)
		}
		s.cmd = exec.Command("nbdkit", args...)
		s.cmd.Stdout, s.cmd.Stderr = logf, logf
		s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := s.cmd.Start(); err != nil {
			logf.Close()
			t.Fatalf("starting nbdkit: %v", err)
		}
		s.done = make(chan struct{})
		go func() { _ = s.cmd.Wait(); close(s.done) }()
		ok := wait.PollUntilContextTimeout(t.Context(), 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			select {
			case <-s.done:
				return true, nil
			default:
			}
			_, err := os.Stat(pidfile)
			return err == nil, nil
		}) == nil
		select {
		case <-s.done:
			ok = false
		default:
		}
		logf.Close()
		log, _ := os.ReadFile(logf.Name())
		_ = os.Remove(logf.Name())
		if ok {
			t.Cleanup(s.Stop)
			return s
		}
		s.Stop()
		lastErr = fmt.Errorf("nbdkit %v did not start: %s", args, log)
	}
	t.Fatal(lastErr)
	return nil
}

// Stop kills the server and waits for it: the "server goes away" event.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}
