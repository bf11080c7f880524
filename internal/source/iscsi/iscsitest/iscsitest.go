// Package iscsitest starts real iSCSI targets (tgt's tgtd on 127.0.0.1, a
// port of its own) for tests, on the host and inside the VM test's guest.
package iscsitest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/testenv"
)

// Target is a running tgtd with one target.
type Target struct {
	Portal      string // 127.0.0.1:PORT
	IQN         string
	ControlPort int
	// LUNs are the backing files by LUN number (tgtd keeps LUN 0 for its
	// controller, so disks start at 1).
	LUNs map[int]string
	cmd  *exec.Cmd
	done chan struct{}
}

// Options tune StartTgtd.
type Options struct {
	IQN string
	// LUNSizes makes LUN i+1 a sparse file of LUNSizes[i] bytes.
	LUNSizes []int64
	// CHAPUser and CHAPPassword, when set, make the target require CHAP.
	// (They are on tgtadm's command line: this is the target's side.)
	CHAPUser, CHAPPassword string
	// Port, when set, is the portal's TCP port (a target started again
	// where initiators knew it, as after the VM test's reboot); 0: a free
	// one.
	Port int
}

// StartTgtd starts tgtd serving one target with the options' LUNs, backed
// by files in dir; a backing file already there keeps its content (the
// same target started again). It skips when tgt is not installed and
// stops tgtd in a cleanup.
func StartTgtd(t testing.TB, dir string, o Options) *Target {
	t.Helper()
	testenv.RequireCommands(t, "tgtd", "tgtadm")
	if o.IQN == "" {
		o.IQN = "iqn.2024-01.io.mountplan.test:disk"
	}
	port := o.Port
	if port == 0 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	tg := &Target{Portal: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), IQN: o.IQN, ControlPort: controlPort(), LUNs: map[int]string{}}
	logPath := filepath.Join(dir, "tgtd.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	tg.cmd = exec.Command("tgtd", "-f", "--control-port", strconv.Itoa(tg.ControlPort), "--iscsi", "portal="+tg.Portal)
	tg.cmd.Stdout, tg.cmd.Stderr = logf, logf
	tg.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := tg.cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("starting tgtd: %v", err)
	}
	logf.Close()
	tg.done = make(chan struct{})
	go func() { _ = tg.cmd.Wait(); close(tg.done) }()
	t.Cleanup(tg.Stop)
	if wait.PollUntilContextTimeout(t.Context(), 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return tg.adm("--mode", "system", "--op", "show") == nil, nil
	}) != nil {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("tgtd did not start: %s", b)
	}
	must := func(args ...string) {
		if err := tg.adm(args...); err != nil {
			t.Fatal(err)
		}
	}
	must("--mode", "target", "--op", "new", "--tid", "1", "-T", o.IQN)
	for i, size := range o.LUNSizes {
		lun := i + 1
		p := filepath.Join(dir, fmt.Sprintf("lun%d.img", lun))
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		f.Close()
		must("--mode", "logicalunit", "--op", "new", "--tid", "1", "--lun", strconv.Itoa(lun), "-b", p)
		tg.LUNs[lun] = p
	}
	must("--mode", "target", "--op", "bind", "--tid", "1", "-I", "ALL")
	if o.CHAPUser != "" {
		must("--mode", "account", "--op", "new", "--user", o.CHAPUser, "--password", o.CHAPPassword)
		must("--mode", "account", "--op", "bind", "--tid", "1", "--user", o.CHAPUser)
	}
	return tg
}

// controlPort picks a tgtd control port (below 32768, tgtd's limit) whose
// socket does not exist yet.
func controlPort() int {
	for {
		n := 1024 + rand.IntN(32768-1024)
		if _, err := os.Stat(fmt.Sprintf("/var/run/tgtd/socket.%d", n)); err != nil {
			return n
		}
	}
}

func (tg *Target) adm(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	full := append([]string{"-C", strconv.Itoa(tg.ControlPort), "--lld", "iscsi"}, args...)
	out, err := exec.CommandContext(ctx, "tgtadm", full...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("tgtadm %s: %v: %s", strings.Join(args[:4], " "), err, out)
	}
	return nil
}

// Stop kills tgtd (it ignores SIGTERM) and removes its control sockets.
func (tg *Target) Stop() {
	if tg.cmd == nil || tg.cmd.Process == nil {
		return
	}
	_ = tg.cmd.Process.Kill()
	<-tg.done
	for _, suffix := range []string{"", ".lock"} {
		_ = os.Remove(fmt.Sprintf("/var/run/tgtd/socket.%d%s", tg.ControlPort, suffix))
	}
}
