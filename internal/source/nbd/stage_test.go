package nbd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nbdnl"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/internal/source/sourcetest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// fakeKernel is the mounter and the kernel's NBD driver behind it, for a
// machine without nbd (the VM test has the real ones): it keeps each
// device's socket as the kernel would, shows the backend in a fake sysfs
// (what the plugin reads), drops a socket given while the connection
// lives, and speaks transmission over the socket on request.
type fakeKernel struct {
	t      *testing.T
	sysDir string

	mu          sync.Mutex
	socks       map[int]net.Conn // the kernel's reference to each device's socket
	dead        map[int]bool
	requests    map[int]mounter.NBDRequest
	calls       []string
	failConnect error // returned after connecting (a call cut off late)
	formats     []mounter.Device
}

func newFakeKernel(t *testing.T) *fakeKernel {
	t.Helper()
	k := &fakeKernel{t: t, sysDir: t.TempDir(), socks: map[int]net.Conn{}, dead: map[int]bool{}, requests: map[int]mounter.NBDRequest{}}
	if err := os.MkdirAll(filepath.Join(k.sysDir, "module", "nbd"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		for _, c := range k.socks {
			c.Close()
		}
	})
	return k
}

func (k *fakeKernel) write(rel, content string) {
	p := filepath.Join(k.sysDir, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		k.t.Error(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		k.t.Error(err)
	}
}

func (k *fakeKernel) take(sock *os.File) net.Conn {
	c, err := net.FileConn(sock) // a duplicate: the caller closes its own
	if err != nil {
		k.t.Errorf("the socket handed over: %v", err)
	}
	return c
}

func (k *fakeKernel) log(format string, args ...any) {
	k.calls = append(k.calls, fmt.Sprintf(format, args...))
}

func (k *fakeKernel) ConnectNBD(_ context.Context, req mounter.NBDRequest, sock *os.File) (mounter.Device, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if sock == nil || !strings.HasPrefix(req.Backend, mounter.NBDBackendPrefix) {
		return mounter.Device{}, errdefs.ErrInvalidArgument
	}
	i := 0
	for k.socks[i] != nil {
		i++
	}
	k.socks[i], k.requests[i] = k.take(sock), req
	k.write(fmt.Sprintf("block/nbd%d/backend", i), req.Backend+"\n")
	k.write(fmt.Sprintf("class/block/nbd%d/dev", i), fmt.Sprintf("43:%d\n", i*32))
	k.log("connect nbd%d", i)
	if k.failConnect != nil {
		return mounter.Device{}, k.failConnect
	}
	return mounter.Device{Path: fmt.Sprintf("/dev/nbd%d", i), Major: 43, Minor: uint32(i * 32)}, nil
}

func (k *fakeKernel) index(backend string) int {
	for i := range k.socks {
		if b, _ := os.ReadFile(filepath.Join(k.sysDir, fmt.Sprintf("block/nbd%d/backend", i))); strings.TrimSpace(string(b)) == backend {
			return i
		}
	}
	return -1
}

func (k *fakeKernel) ReconnectNBD(_ context.Context, dev mounter.Device, backend string, sock *os.File) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	i := k.index(backend)
	if i < 0 || sock == nil || dev.Minor != uint32(i*32) {
		return fmt.Errorf("reconnect %+v %s: %w", dev, backend, errdefs.ErrNotFound)
	}
	c := k.take(sock)
	if !k.dead[i] {
		k.log("reconnect nbd%d dropped", i)
		c.Close() // no dead connection to replace: the kernel drops it
		return nil
	}
	k.socks[i].Close()
	k.socks[i], k.dead[i] = c, false
	k.log("reconnect nbd%d", i)
	return nil
}

func (k *fakeKernel) DisconnectNBD(_ context.Context, dev mounter.Device, backend string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	i := k.index(backend)
	k.log("disconnect %s %d:%d", backend, dev.Major, dev.Minor)
	if i < 0 {
		return nil
	}
	if dev != (mounter.Device{}) && dev.Minor != uint32(i*32) {
		return errdefs.ErrPermissionDenied
	}
	k.socks[i].Close()
	delete(k.socks, i)
	delete(k.dead, i)
	_ = os.RemoveAll(filepath.Join(k.sysDir, fmt.Sprintf("block/nbd%d", i)))
	return nil
}

// kill is the kernel finding device i's connection dead.
func (k *fakeKernel) kill(i int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.dead[i] = true
}

// forget is a reboot, or a disconnect behind the plugin's back.
func (k *fakeKernel) forget(i int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if c := k.socks[i]; c != nil {
		c.Close()
	}
	delete(k.socks, i)
	_ = os.RemoveAll(filepath.Join(k.sysDir, fmt.Sprintf("block/nbd%d", i)))
}

// readWrite writes a block through device i's socket and reads it back,
// as the kernel does for the filesystem above it.
func (k *fakeKernel) readWrite(t *testing.T, i int, off uint64, data []byte) {
	t.Helper()
	k.mu.Lock()
	c := k.socks[i]
	k.mu.Unlock()
	if c == nil {
		t.Fatalf("nbd%d has no socket", i)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	x := &txConn{t: t, c: c, handle: uint64(time.Now().UnixNano())}
	x.request(cmdWrite, off, uint32(len(data)), data)
	x.reply(0)
	x.request(cmdRead, off, uint32(len(data)), nil)
	if got := x.reply(len(data)); !bytes.Equal(got, data) {
		t.Fatalf("read back through nbd%d: %q..., want %q...", i, got[:16], data[:16])
	}
}

func (k *fakeKernel) Detect(context.Context, mounter.Device) (string, error) { return "", nil }
func (k *fakeKernel) Format(_ context.Context, d mounter.Device, _ string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.formats = append(k.formats, d)
	return nil
}
func (k *fakeKernel) GrowFS(context.Context, mounter.Device, string, bool) error { return nil }
func (k *fakeKernel) Freeze(context.Context, mounter.Device, string) error       { return nil }
func (k *fakeKernel) Thaw(context.Context, mounter.Device, string) error         { return nil }
func (k *fakeKernel) ApplyGroup(context.Context, []plan.Mount, uint32) error     { return nil }
func (k *fakeKernel) ReplayLog(context.Context, string, uint32) error            { return nil }
func (k *fakeKernel) callLog() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return strings.Join(k.calls, "; ")
}
func (k *fakeKernel) connected() int { k.mu.Lock(); defer k.mu.Unlock(); return len(k.socks) }
func (k *fakeKernel) request(i int) mounter.NBDRequest {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.requests[i]
}

// fakeWatch is the kernel's link-dead notices.
type fakeWatch struct{ c chan int }

func (w fakeWatch) Next(ctx context.Context) (int, error) {
	select {
	case i := <-w.c:
		return i, nil
	case <-ctx.Done():
		return -1, ctx.Err()
	}
}
func (w fakeWatch) Close() error { return nil }

// stageEnv is a source over the fake kernel and an nbdkit serving "vol".
type stageEnv struct {
	k      *fakeKernel
	dead   chan int
	srv    *nbdtest.Server
	dir    string
	export string
	cfg    config.NBDConfig
	tlsDir string
}

func newStageEnv(t *testing.T, withTLS bool) *stageEnv {
	t.Helper()
	e := &stageEnv{k: newFakeKernel(t), dead: make(chan int, 8), dir: t.TempDir()}
	e.export = nbdtest.AddExport(t, e.dir, "vol", 16<<20)
	e.cfg = config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 5}
	o := nbdtest.Options{}
	if withTLS {
		e.tlsDir = t.TempDir()
		e.cfg.TLS = &config.NBDTLS{CAFile: writeTLSFiles(t, e.tlsDir), Required: true}
		o.TLSDir = e.tlsDir
	}
	e.srv = nbdtest.StartNbdkit(t, e.dir, o)
	return e
}

// source is a plugin process's NBD source.
func (e *stageEnv) source(t *testing.T) *Source {
	t.Helper()
	s := New(e.cfg, e.k, nil)
	s.SysDir = e.k.sysDir
	s.DeadConnTimeout = 30 * time.Second
	s.watchLinks = func() (linkWatcher, error) { return fakeWatch{e.dead}, nil }
	t.Cleanup(func() { s.Close() })
	return s
}

func (e *stageEnv) volume(t *testing.T, s *Source, id string) source.Volume {
	t.Helper()
	v, err := s.NewVolume(id, map[string]string{"address": e.srv.Address, "export": "vol"})
	if err != nil {
		t.Fatal(err)
	}
	v.Staging = true
	return v
}

func stage(t *testing.T, s *Source, v source.Volume, rec *sourcetest.Recorder) (source.Volume, State) {
	t.Helper()
	raw, err := s.Stage(context.Background(), v, source.StageRequest{FsType: "ext4", Record: rec})
	if err != nil {
		t.Fatalf("Stage: %v", err)
	}
	v = sourcetest.Staged(v, raw)
	var st State
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	return v, st
}

// proxies counts the goroutines of TLS proxies in this process.
func proxies() int {
	buf := make([]byte, 1<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "(*proxy).pipe")
}

func waitProxies(t *testing.T, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for proxies() != 2*want {
		if time.Now().After(deadline) {
			t.Fatalf("%d proxy goroutines, want %d (%d proxies)", proxies(), 2*want, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStageThroughTheMounter: stage negotiates, records the backend before
// the connect, hands the socket to the mounter (which hands it to the
// kernel), formats the device by number; the kernel's socket reaches the
// export; unstage disconnects by backend and leaves nothing running. For
// TLS the proxy runs from stage to unstage.
func TestStageThroughTheMounter(t *testing.T) {
	for _, withTLS := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "tls"}[withTLS], func(t *testing.T) {
			e := newStageEnv(t, withTLS)
			goroutines := runtime.NumGoroutine()
			s := e.source(t)
			v := e.volume(t, s, "vol-1")
			rec := &sourcetest.Recorder{}
			v, st := stage(t, s, v, rec)
			t.Logf("state %s; calls: %s", v.State, e.k.callLog())

			var intent State
			if len(rec.Intents) != 2 || json.Unmarshal(rec.Intents[0], &intent) != nil || !intent.Pending || intent.Index != -1 || intent.Backend != st.Backend {
				t.Fatalf("intents %s, want the backend recorded (pending) before the connect", rec.Intents)
			}
			if !strings.HasPrefix(st.Backend, mounter.NBDBackendPrefix+"vol-1:") || st.Device != "/dev/nbd0" || st.Index != 0 || st.Pending ||
				st.Size != 16<<20 || st.BlockSize != 4096 || st.FsType != "ext4" || st.TLS != withTLS {
				t.Fatalf("state %+v", st)
			}
			req := e.k.request(0)
			if req.Backend != st.Backend || req.SizeBytes != 16<<20 || req.BlockSize != 4096 || req.DeadConnTimeout != 30*time.Second ||
				req.Timeout != 5*time.Second || req.ServerFlags&nbdnl.FlagHasFlags == 0 || req.ServerFlags&nbdnl.FlagReadOnly != 0 {
				t.Fatalf("the mounter was asked %+v", req)
			}
			if len(e.k.formats) != 1 || e.k.formats[0] != (mounter.Device{Path: "/dev/nbd0", Major: 43, Minor: 0}) {
				t.Fatalf("formats %+v", e.k.formats)
			}
			want := bytes.Repeat([]byte("through the kernel's socket "), 4096/28+1)[:4096]
			e.k.readWrite(t, 0, 1<<20, want)
			if got := fileAt(t, e.export, 1<<20, 4096); !bytes.Equal(got, want) {
				t.Fatal("the write did not reach the export")
			}
			if withTLS {
				waitProxies(t, 1)
			} else if proxies() != 0 {
				t.Fatal("a plain volume runs a proxy")
			}
			mounts, err := s.Plan(v, source.PlanRequest{})
			if err != nil || len(mounts) != 1 || mounts[0].Source != "/dev/nbd0" || mounts[0].Type != "ext4" {
				t.Fatalf("plan %+v, %v", mounts, err)
			}
			if h := s.Health(context.Background(), v); h.Abnormal {
				t.Fatalf("health after stage: %+v", h)
			}
			if err := s.Unstage(context.Background(), v); err != nil {
				t.Fatal(err)
			}
			if e.k.connected() != 0 || !strings.Contains(e.k.callLog(), "disconnect "+st.Backend+" 43:0") {
				t.Fatalf("after unstage: %d connected; calls %s", e.k.connected(), e.k.callLog())
			}
			if h := s.Health(context.Background(), v); h.Reason != "DeviceDisconnected" {
				t.Fatalf("health after unstage: %+v", h)
			}
			if err := s.Unstage(context.Background(), v); err != nil {
				t.Fatalf("second unstage: %v", err)
			}
			waitProxies(t, 0)
			if len(s.links) != 0 || s.watch != nil {
				t.Fatalf("links %v or watcher %v left", s.links, s.watch)
			}
			waitSettled(t, goroutines+1, 1<<20) // +1: the nbdkit waiter of this subtest
		})
	}
}

// TestPluginRestartTLS: the plugin process ends (its TLS proxy dies, the
// kernel holds the device's I/O); the next one's Adopt negotiates again
// and the mounter gives the kernel the new socket; the data is there.
func TestPluginRestartTLS(t *testing.T) {
	e := newStageEnv(t, true)
	s1 := e.source(t)
	v, st := stage(t, s1, e.volume(t, s1, "vol-tls"), &sourcetest.Recorder{})
	want := bytes.Repeat([]byte("before the restart "), 512/19+1)[:512]
	e.k.readWrite(t, 0, 0, want)

	s1.Close() // the process exits: nothing disconnected, the proxy gone
	waitProxies(t, 0)
	e.k.kill(0)
	if e.k.connected() != 1 {
		t.Fatal("Close disconnected the device")
	}
	s2 := e.source(t)
	if h := s2.Health(context.Background(), v); h.Reason != "ConnectionLost" {
		t.Fatalf("health before the new process adopted the volume: %+v", h)
	}
	start := time.Now()
	raw, err := s2.Adopt(context.Background(), v)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("adopt with a new handshake: %v; calls %s", time.Since(start), e.k.callLog())
	if string(raw) != string(v.State) || !strings.Contains(e.k.callLog(), "reconnect nbd0") {
		t.Fatalf("adopt: state %s (was %s), calls %s", raw, v.State, e.k.callLog())
	}
	waitProxies(t, 1)
	e.k.readWrite(t, 0, 0, want)
	if h := s2.Health(context.Background(), v); h.Abnormal {
		t.Fatalf("health after adopt: %+v", h)
	}
	// The periodic reconcile adopts again: nothing to do.
	if _, err := s2.Adopt(context.Background(), v); err != nil || strings.Count(e.k.callLog(), "reconnect") != 1 {
		t.Fatalf("a second adopt: %v; calls %s", err, e.k.callLog())
	}
	if err := s2.Unstage(context.Background(), v); err != nil {
		t.Fatal(err)
	}
	waitProxies(t, 0)
	_ = st
}

// TestServerRestartPlain: the server goes away under a plain volume; the
// kernel reports the link dead; health says so while reconnects fail;
// the server comes back on its port and the connection with it.
func TestServerRestartPlain(t *testing.T) {
	old := retryMin
	retryMin = 50 * time.Millisecond
	t.Cleanup(func() { retryMin = old })
	e := newStageEnv(t, false)
	s := e.source(t)
	v, st := stage(t, s, e.volume(t, s, "vol-plain"), &sourcetest.Recorder{})
	e.srv.Stop()
	e.k.kill(st.Index)
	e.dead <- st.Index
	deadline := time.Now().Add(5 * time.Second)
	for {
		h := s.Health(context.Background(), v)
		if h.Reason == "ConnectionLost" && strings.Contains(h.Message, "unreachable") {
			t.Logf("health with the server gone: %s", h.Message)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health with the server gone: %+v", h)
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.srv = nbdtest.StartNbdkit(t, e.dir, nbdtest.Options{Port: e.srv.Port})
	for !strings.Contains(e.k.callLog(), "reconnect nbd0") {
		if time.Now().After(deadline.Add(10 * time.Second)) {
			t.Fatalf("not reconnected: %s", e.k.callLog())
		}
		time.Sleep(20 * time.Millisecond)
	}
	data := bytes.Repeat([]byte{0x5a}, 512)
	e.k.readWrite(t, 0, 4096, data)
	if h := s.Health(context.Background(), v); h.Abnormal {
		t.Fatalf("health after the reconnect: %+v", h)
	}
	if err := s.Unstage(context.Background(), v); err != nil {
		t.Fatal(err)
	}
}

// TestAdoptPlainAndReboot: a new process adopts a plain volume whose
// device lives on (one harmless reconnect, dropped by the kernel), and
// connects a volume whose device a reboot took again, with a new backend.
func TestAdoptPlainAndReboot(t *testing.T) {
	e := newStageEnv(t, false)
	s1 := e.source(t)
	v, st := stage(t, s1, e.volume(t, s1, "vol-a"), &sourcetest.Recorder{})
	s1.Close()
	s2 := e.source(t)
	if raw, err := s2.Adopt(context.Background(), v); err != nil || string(raw) != string(v.State) {
		t.Fatalf("adopt of a live plain device: %s, %v", raw, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(e.k.callLog(), "reconnect nbd0 dropped") {
		if time.Now().After(deadline) {
			t.Fatalf("no reconnect attempt after adopt: %s", e.k.callLog())
		}
		time.Sleep(10 * time.Millisecond)
	}
	e.k.readWrite(t, 0, 0, bytes.Repeat([]byte{1}, 512))

	e.k.forget(0) // a reboot
	if h := s2.Health(context.Background(), v); h.Reason != "DeviceDisconnected" {
		t.Fatalf("health after the reboot: %+v", h)
	}
	raw, err := s2.Adopt(context.Background(), v)
	if err != nil {
		t.Fatal(err)
	}
	var fresh State
	if err := json.Unmarshal(raw, &fresh); err != nil {
		t.Fatal(err)
	}
	if fresh.Backend == st.Backend || fresh.FsType != "ext4" || fresh.Pending || !s2.shows(fresh) {
		t.Fatalf("state after adopt of a rebooted node: %+v (was %+v)", fresh, st)
	}
	v = sourcetest.Staged(v, raw)
	if err := s2.Unstage(context.Background(), v); err != nil || e.k.connected() != 0 {
		t.Fatalf("unstage: %v, %d connected", err, e.k.connected())
	}
}

// TestStageUndo: a connect whose answer is lost (the call cut off after
// the mounter connected) leaves nothing: the device is found and
// disconnected by its backend; so is the device of an intent a crash
// left behind.
func TestStageUndo(t *testing.T) {
	e := newStageEnv(t, true)
	s := e.source(t)
	v := e.volume(t, s, "vol-u")
	e.k.failConnect = fmt.Errorf("mounter: call cut off: %w", errdefs.ErrUnavailable)
	rec := &sourcetest.Recorder{}
	_, err := s.Stage(context.Background(), v, source.StageRequest{FsType: "ext4", Record: rec})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Stage with the connect's answer lost: %v", err)
	}
	if e.k.connected() != 0 || !strings.Contains(e.k.callLog(), "disconnect mountplan:vol-u:") || len(s.links) != 0 {
		t.Fatalf("left connected: %d; calls %s; links %v", e.k.connected(), e.k.callLog(), s.links)
	}
	waitProxies(t, 0)

	// A crash after the connect, before the device was recorded: the
	// intent holds the backend only.
	e.k.failConnect = nil
	_, st := stage(t, s, v, rec)
	s.Close()
	intent := st
	intent.Index, intent.Device, intent.Pending, intent.FsType = -1, "", true, ""
	raw, _ := json.Marshal(intent)
	if err := e.source(t).Unstage(context.Background(), sourcetest.Staged(v, raw)); err != nil {
		t.Fatal(err)
	}
	if e.k.connected() != 0 {
		t.Fatalf("the intent's device is still connected: %s", e.k.callLog())
	}
}

func TestBlockSize(t *testing.T) {
	for _, tc := range []struct {
		size             int64
		least, pref, max uint32
		want             uint64
	}{
		{16 << 20, 0, 0, 0, 4096},
		{16<<20 + 512, 0, 0, 0, 512},
		{16 << 20, 1, 512, 1 << 20, 512},
		{16 << 20, 1, 65536, 1 << 20, 4096}, // beyond the page: the kernel refuses it
		{16 << 20, 1, 256, 1 << 20, 4096},
		{16<<20 + 1024, 512, 1024, 4096, 1024},
		{16<<20 + 512, 4096, 4096, 4096, 512}, // does not divide the size
	} {
		tr := &Transmission{Export: Export{Size: tc.size}, MinBlockSize: tc.least, BlockSize: tc.pref, MaxBlockSize: tc.max}
		if got := blockSize(tr); got != tc.want {
			t.Errorf("blockSize(size %d, %d/%d/%d) = %d, want %d", tc.size, tc.least, tc.pref, tc.max, got, tc.want)
		}
	}
}
