//go:build vmguest

package guest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/nbdnl"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/nbd"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// These tests run NBD volumes as the plugin and the mounter split them:
// the plugin's source dials and negotiates (TLS through its proxy) with
// no privilege and hands the socket to the mounter over its unix socket
// (SCM_RIGHTS), which connects the device through nbdnl.

// proxyGoroutines counts the goroutines of TLS proxies in this process.
func proxyGoroutines() int {
	buf := make([]byte, 4<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "nbd.(*proxy).pipe")
}

// noNBDLeft fails unless no device is connected and no proxy runs.
func noNBDLeft(t *testing.T) {
	t.Helper()
	waitFor(t, "no NBD device connected and no TLS proxy running", func() bool {
		return len(connectedNBD()) == 0 && proxyGoroutines() == 0
	})
}

// tlsNbdkit starts a TLS-only nbdkit over dir and returns it with the
// admin's nbd.tls that trusts it.
func tlsNbdkit(t *testing.T, dir string) (*nbdtest.Server, *config.NBDTLS) {
	t.Helper()
	tlsDir := t.TempDir()
	writeTestCerts(t, tlsDir)
	return nbdtest.StartNbdkit(t, dir, nbdtest.Options{TLSDir: tlsDir}), &config.NBDTLS{CAFile: filepath.Join(tlsDir, "ca-cert.pem"), Required: true}
}

// fsyncPath syncs the file at p: its data reaches the device.
func fsyncPath(p string) error {
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// TestNBDPluginRestartTLS: a TLS volume is published when the plugin's
// process ends: its proxy dies with it and the kernel holds the device's
// I/O (a write issued meanwhile waits). The next plugin process (a new
// source and driver over the same state dir and mounter) reconciles:
// Adopt negotiates again and the mounter gives the kernel the new socket.
// The waiting write completes, the data reads back from the server, and
// unstage leaves no device and no proxy.
func TestNBDPluginRestartTLS(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "secure", 64<<20)
	srv, tlsCfg := tlsNbdkit(t, dir)
	cfg := &config.Config{NBD: config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10, TLS: tlsCfg}}
	var first *nbd.Source
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		first = nbd.New(cfg.NBD, m, nil)
		return map[string]source.Source{nbd.Type: first}
	})
	f := &flow{t: t, d: d, stateDir: stateDir, id: "nbd-tls", vctx: map[string]string{"type": "nbd", "address": srv.Address, "export": "secure"}}
	start := time.Now()
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st := f.state()
	t.Logf("TLS stage with format: %v, state %s", time.Since(start), st)
	if !st.has(`"tls":true`) || !st.has(`"backend":"mountplan:nbd-tls:`) {
		t.Fatalf("state %s", st)
	}
	if n := proxyGoroutines(); n != 2 {
		t.Fatalf("%d proxy goroutines after a TLS stage, want 2 (one proxy)", n)
	}
	f.publish()
	kept := filepath.Join(f.target(), "kept.txt")
	want := []byte("written before the plugin restarted\n")
	writeSynced(t, kept, want)

	// The plugin's process ends: nothing disconnected, the proxy gone.
	first.Close()
	if n := proxyGoroutines(); n != 0 {
		t.Fatalf("%d proxy goroutines after the process ended", n)
	}
	if len(connectedNBD()) != 1 {
		t.Fatalf("the device went with the plugin: %v", connectedNBD())
	}
	during := []byte("written while no plugin ran\n")
	wrote := make(chan error, 1)
	go func() {
		err := os.WriteFile(filepath.Join(f.target(), "during.txt"), during, 0o644)
		if err == nil {
			err = fsyncPath(filepath.Join(f.target(), "during.txt"))
		}
		wrote <- err
	}()
	time.Sleep(500 * time.Millisecond)
	select {
	case err := <-wrote:
		t.Fatalf("a synced write completed with no connection to the server: %v", err)
	default:
	}

	start = time.Now()
	d2, _ := newDriverAt(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{nbd.Type: nbd.New(cfg.NBD, m, nil)}
	}, stateDir)
	t.Logf("restarted plugin's reconcile (TLS handshake, ReconnectNBD across the mounter's socket): %v", time.Since(start))
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatalf("the write issued while no plugin ran: %v", err)
		}
		t.Logf("the write issued while no plugin ran completed %v after the restart began", time.Since(start))
	case <-time.After(20 * time.Second):
		t.Fatal("the write issued while no plugin ran did not complete after the reconnect")
	}
	if after := f.state(); !bytes.Equal(after, st) {
		t.Fatalf("state changed by the restart: %s (was %s)", after, st)
	}
	if n := proxyGoroutines(); n != 2 {
		t.Fatalf("%d proxy goroutines after the restart, want 2", n)
	}
	readFromDevice(t, kept, want)
	readFromDevice(t, filepath.Join(f.target(), "during.txt"), during)
	if h := health(t, d2, f.id); h != nil {
		t.Fatalf("health after the restart: %v", h)
	}
	f.d = d2
	f.unpublish()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	noNBDLeft(t)
}

// TestNBDServerRestart: the server of a published plain volume goes away;
// the kernel reports the link dead (WatchLinkDead in the plugin, with no
// privilege) and holds the I/O; health says the connection is lost; the
// server comes back on its port and the plugin reconnects the device
// through the mounter, by itself; the data written before reads back.
func TestNBDServerRestart(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "vol", 64<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	cfg := &config.Config{NBD: config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10}}
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{nbd.Type: nbd.New(cfg.NBD, m, nil)}
	})
	f := &flow{t: t, d: d, stateDir: stateDir, id: "nbd-srv", vctx: map[string]string{"type": "nbd", "address": srv.Address, "export": "vol"}}
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	f.publish()
	kept := filepath.Join(f.target(), "kept.txt")
	want := []byte("written before the server went away\n")
	writeSynced(t, kept, want)

	srv.Stop()
	stopped := time.Now()
	waitFor(t, "health to report the lost connection", func() bool {
		h := health(t, d, f.id)
		return h != nil && h.GetReason() == "ConnectionLost"
	})
	t.Logf("health %v after the server stopped: %v", time.Since(stopped), health(t, d, f.id))
	nbdtest.StartNbdkit(t, dir, nbdtest.Options{Port: srv.Port})
	back := time.Now()
	waitFor(t, "the plugin to reconnect the device", func() bool { return health(t, d, f.id) == nil })
	t.Logf("reconnected %v after the server came back", time.Since(back))
	readFromDevice(t, kept, want)
	more := []byte("written after the reconnect\n")
	writeSynced(t, filepath.Join(f.target(), "more.txt"), more)
	readFromDevice(t, filepath.Join(f.target(), "more.txt"), more)
	f.unpublish()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	noNBDLeft(t)
}

// TestNBDForeignDevice (hostile): devices connected by someone else
// through the same netlink interface, with another driver's backend or
// with one of mountplan's form that the mounter never recorded, are not
// the mounter's: a plan naming them, a format of them, and reconnects or
// disconnects of their backends are refused (PermissionDenied,
// InvalidArgument, NotFound), or touch nothing; the devices stay
// connected. The mounter's own device beside them works.
func TestNBDForeignDevice(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "theirs", 32<<20)
	nbdtest.AddExport(t, dir, "ours", 32<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	cfg := &config.Config{NBD: config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10}}
	var m *service.Client
	d, stateDir := newDriver(t, cfg, func(c *service.Client) map[string]source.Source {
		m = c
		return map[string]source.Source{nbd.Type: nbd.New(cfg.NBD, c, nil)}
	})
	dialer := nbd.Dialer{Network: "tcp", Address: srv.Address, Timeout: 10 * time.Second}
	forged, err := mounter.NewNBDBackend("nbd-ours")
	if err != nil {
		t.Fatal(err)
	}
	var foreign []*nlDevice
	for _, backend := range []string{"rbd-nbd:pool/image", forged} {
		foreign = append(foreign, connectNL(t, dialer, "theirs", backend, 0))
	}
	f := &flow{t: t, d: d, stateDir: stateDir, id: "nbd-ours", vctx: map[string]string{"type": "nbd", "address": srv.Address, "export": "ours"}}
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume beside the foreign devices: %v", err)
	}
	if st := f.state(); bytes.Contains(st, []byte(forged)) {
		t.Fatalf("the stage took the forged backend: %s", st)
	}
	ctx := context.Background()
	target := filepath.Join(stateDir, "foreign-target")
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(target+".blk", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, n := range foreign {
		backend := sysfs(t, n.index, "backend")
		major, minor, err := nbdnl.DeviceNumber(n.index)
		if err != nil {
			t.Fatal(err)
		}
		dev := mounter.Device{Path: n.dev, Major: major, Minor: minor}
		what := fmt.Sprintf("%s (backend %s)", n.dev, backend)
		for _, tc := range []struct {
			name   string
			mounts []plan.Mount
			mp     string
		}{
			{"a plan mounting it", []plan.Mount{{Type: "ext4", Source: n.dev, Options: []string{"nosuid", "nodev"}}}, target},
			{"a plan binding it", []plan.Mount{{Type: plan.TypeBind, Source: n.dev, Options: []string{"nosuid"}}}, target + ".blk"},
		} {
			err := m.Mount(ctx, tc.mounts, plan.Consumer{MountPoint: tc.mp})
			if !errors.Is(err, errdefs.ErrPermissionDenied) {
				t.Fatalf("%s naming %s: %v, want PermissionDenied", tc.name, what, err)
			}
			t.Logf("%s naming %s: %v", tc.name, what, err)
		}
		if err := m.Format(ctx, dev, "ext4"); !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Fatalf("format of %s: %v, want PermissionDenied", what, err)
		}
		sock := spareSocket(t, dialer)
		err = m.ReconnectNBD(ctx, dev, backend, sock)
		if !errors.Is(err, errdefs.ErrInvalidArgument) && !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("reconnect of %s: %v, want InvalidArgument or NotFound", what, err)
		}
		t.Logf("reconnect of %s: %v", what, err)
		if err := m.DisconnectNBD(ctx, dev, backend); err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("disconnect of %s: %v, want nothing done", what, err)
		}
		if got := sysfs(t, n.index, "backend"); got != backend {
			t.Fatalf("%s now shows backend %q", what, got)
		}
		wantStatus(t, n.index, true)
	}
	f.writeRemountRead()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	for _, n := range foreign {
		wantStatus(t, n.index, true)
		if err := nbdnl.Disconnect(n.index); err != nil {
			t.Fatal(err)
		}
		wantStatus(t, n.index, false)
	}
	noNBDLeft(t)
}

// spareSocket is a negotiated socket nobody uses.
func spareSocket(t *testing.T, d nbd.Dialer) *os.File {
	t.Helper()
	tr, err := d.Negotiate(context.Background(), "theirs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr.Socket
}

// TestNBDUnprivilegedWatch: what the plugin does of NBD needs no
// privilege. A child of this test running as nobody (no capability) is
// refused a connect (PermissionDenied), yet hears the kernel's link-dead
// notice of a device the test connected and reads its backend in sysfs.
func TestNBDUnprivilegedWatch(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "w", 16<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	n := connectNL(t, nbd.Dialer{Network: "tcp", Address: srv.Address, Timeout: 10 * time.Second}, "w", "mountplan:watched:"+strings.Repeat("0f", 16), 30*time.Second)

	cmd := exec.Command(os.Args[0], "-test.run=^TestNBDUnprivilegedChild$", "-test.v")
	cmd.Env = append(os.Environ(), "MOUNTPLAN_NBD_CHILD="+strconv.Itoa(n.index))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(out)
	var seen []string
	expect := func(prefix string) string {
		t.Helper()
		for lines.Scan() {
			seen = append(seen, lines.Text())
			if strings.HasPrefix(lines.Text(), prefix) {
				return lines.Text()
			}
		}
		t.Fatalf("the unprivileged child never said %q:\n%s", prefix, strings.Join(seen, "\n"))
		return ""
	}
	if who := expect("child: "); who != "child: Uid: 65534 CapEff: 0000000000000000" {
		t.Fatalf("the child is not unprivileged: %q", who)
	}
	expect("child: subscribed")
	srv.Stop() // the connection dies
	got := expect("child: dead ")
	t.Log(got)
	if got != fmt.Sprintf("child: dead nbd%d backend %s", n.index, sysfs(t, n.index, "backend")) {
		t.Fatalf("the child heard %q", got)
	}
	for lines.Scan() {
		seen = append(seen, lines.Text())
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the unprivileged child: %v\n%s", err, strings.Join(seen, "\n"))
	}
}

// TestNBDUnprivilegedChild is TestNBDUnprivilegedWatch's child.
func TestNBDUnprivilegedChild(t *testing.T) {
	index, err := strconv.Atoi(os.Getenv("MOUNTPLAN_NBD_CHILD"))
	if err != nil {
		return // not run as the child (a skip would fail the VM test)
	}
	status, _ := os.ReadFile("/proc/self/status")
	var who []string
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) > 1 && (f[0] == "Uid:" || f[0] == "CapEff:") {
			who = append(who, f[0]+" "+f[1])
		}
	}
	fmt.Printf("child: %s\n", strings.Join(who, " "))
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	sock := os.NewFile(uintptr(fds[0]), "sock")
	defer sock.Close()
	defer syscall.Close(fds[1])
	_, err = nbdnl.Connect(nbdnl.Config{Index: -1, SizeBytes: 1 << 20, Backend: "mountplan:child:" + strings.Repeat("0f", 16)}, []*os.File{sock})
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("an unprivileged connect: %v, want PermissionDenied", err)
	}
	w, err := nbdnl.WatchLinkDead()
	if err != nil {
		t.Fatalf("WatchLinkDead without privilege: %v", err)
	}
	defer w.Close()
	fmt.Println("child: subscribed")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		dead, err := w.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if dead == index {
			fmt.Printf("child: dead nbd%d backend %s\n", dead, nbdnl.Backend(dead))
			return
		}
	}
}
