package mounter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/nbdnl"
)

// fakeNBD is the kernel's NBD driver as the node sees it, for a kernel
// without one (the VM test drives the real one): devices by index, each
// with the backend it shows; minors are index*32 as with Debian's
// max_part=16.
type fakeNBD struct {
	mu          sync.Mutex
	backends    map[int]string
	devices     int
	connects    []nbdnl.Config
	reconfigs   []string
	disconnects []int
	failConnect error
}

func newFakeNBD() *fakeNBD { return &fakeNBD{backends: map[int]string{}, devices: 16} }

func (f *fakeNBD) Connect(cfg nbdnl.Config, socks []*os.File) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failConnect != nil {
		return -1, f.failConnect
	}
	if len(socks) != 1 || socks[0] == nil {
		return -1, errdefs.ErrInvalidArgument
	}
	f.connects = append(f.connects, cfg)
	for i := range f.devices {
		if _, busy := f.backends[i]; !busy {
			f.backends[i] = cfg.Backend
			return i, nil
		}
	}
	return -1, errdefs.ErrResourceExhausted
}

func (f *fakeNBD) ReconfigureBackend(index int, backend string, socks []*os.File, _ time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.backends[index] != backend {
		return fmt.Errorf("backend image doesn't match: %w", errdefs.ErrInvalidArgument)
	}
	f.reconfigs = append(f.reconfigs, fmt.Sprintf("nbd%d %s %d", index, backend, len(socks)))
	return nil
}

func (f *fakeNBD) Disconnect(index int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.disconnects = append(f.disconnects, index)
	delete(f.backends, index)
	return nil
}

func (f *fakeNBD) Backend(index int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.backends[index]
}

func (f *fakeNBD) FindBackend(backend string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, b := range f.backends {
		if b == backend {
			return i
		}
	}
	return -1
}

func (f *fakeNBD) DeviceNumber(index int) (uint32, uint32, error) {
	if index < 0 || index >= f.devices {
		return 0, 0, errdefs.ErrNotFound
	}
	return nbdMajor, uint32(index) * 32, nil
}

// set is someone else connecting (or disconnecting, "") device index.
func (f *fakeNBD) set(index int, backend string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if backend == "" {
		delete(f.backends, index)
	} else {
		f.backends[index] = backend
	}
}

func nbdNode(t *testing.T, k *fakeNBD, o Options) *Local {
	t.Helper()
	old := newNBDKernel
	newNBDKernel = func() nbdKernel { return k }
	t.Cleanup(func() { newNBDKernel = old })
	n, err := NewNode(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

// streamSocket returns one end of a connected stream socketpair.
func streamSocket(t *testing.T) *os.File {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := os.NewFile(uintptr(fds[0]), "nbd-sock"), os.NewFile(uintptr(fds[1]), "server")
	t.Cleanup(func() { a.Close(); b.Close() })
	return a
}

func wantNBDErr(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: %v, want %v", what, err, want)
	}
}

func backendFor(t *testing.T, id string) string {
	t.Helper()
	b, err := NewNBDBackend(id)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func nbdRecordFiles(t *testing.T, recordsDir string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(recordsDir, "nbd", "*.json"))
	return m
}

func TestNBDBackendForm(t *testing.T) {
	good := backendFor(t, "pvc-1")
	if err := checkNBDBackend(good); err != nil {
		t.Fatalf("NewNBDBackend's %q refused: %v", good, err)
	}
	if other := backendFor(t, "pvc-1"); other == good {
		t.Fatal("two backends of one volume are the same")
	}
	hex := strings.Repeat("a1", 16)
	for _, b := range []string{"", "rbd-nbd:pvc-1", "nbd://127.0.0.1:10809/vol", "mountplan:pvc-1", "mountplan::" + hex,
		"mountplan:../x:" + hex, "mountplan:a/b:" + hex, "mountplan:pvc-1:" + strings.ToUpper(hex), "mountplan:pvc-1:" + hex[:30],
		"mountplan:pvc-1:" + hex + "00", "Mountplan:pvc-1:" + hex, "mountplan:" + strings.Repeat("v", 129) + ":" + hex} {
		wantNBDErr(t, fmt.Sprintf("backend %q", b), checkNBDBackend(b), errdefs.ErrInvalidArgument)
	}
	if _, err := NewNBDBackend("../x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("NewNBDBackend of a bad volume ID: %v", err)
	}
}

// TestNBDConnect: refusals before the kernel is asked, a connect recorded
// under <records>/nbd, and ownsNBD accepting that device only (review
// finding: any /dev/nbdN was accepted by kind).
func TestNBDConnect(t *testing.T) {
	k := newFakeNBD()
	state, records := t.TempDir(), t.TempDir()
	n := nbdNode(t, k, Options{StateDir: state, RecordsDir: records})
	ctx := context.Background()
	req := NBDRequest{SizeBytes: 64 << 20, BlockSize: 4096, ServerFlags: nbdnl.FlagHasFlags | nbdnl.FlagSendFlush,
		Timeout: 30 * time.Second, DeadConnTimeout: 2 * time.Minute, Backend: backendFor(t, "vol-a")}

	file, err := os.Create(filepath.Join(t.TempDir(), "not-a-socket"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "l.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	listening, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer listening.Close()
	dgram, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	dgramFile := os.NewFile(uintptr(dgram), "dgram")
	defer dgramFile.Close()
	unconnected, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unconnectedFile := os.NewFile(uintptr(unconnected), "unconnected")
	defer unconnectedFile.Close()
	with := func(f func(*NBDRequest)) NBDRequest { r := req; f(&r); return r }
	for _, tc := range []struct {
		name string
		req  NBDRequest
		sock *os.File
	}{
		{"no socket", req, nil},
		{"a regular file", req, file},
		{"a listening socket", req, listening},
		{"a datagram socket", req, dgramFile},
		{"an unconnected socket", req, unconnectedFile},
		{"another driver's backend form", with(func(r *NBDRequest) { r.Backend = "rbd-nbd:pool/img" }), streamSocket(t)},
		{"no size", with(func(r *NBDRequest) { r.SizeBytes = 0 }), streamSocket(t)},
		{"block size not a power of two", with(func(r *NBDRequest) { r.BlockSize = 1000 }), streamSocket(t)},
		{"block size above the page", with(func(r *NBDRequest) { r.BlockSize = 1 << 20 }), streamSocket(t)},
		{"flags beyond 16 bits", with(func(r *NBDRequest) { r.ServerFlags = 1 << 20 }), streamSocket(t)},
		{"a day's timeout", with(func(r *NBDRequest) { r.DeadConnTimeout = 24 * time.Hour }), streamSocket(t)},
		{"a negative timeout", with(func(r *NBDRequest) { r.Timeout = -time.Second }), streamSocket(t)},
	} {
		_, err := n.ConnectNBD(ctx, tc.req, tc.sock)
		wantNBDErr(t, tc.name, err, errdefs.ErrInvalidArgument)
	}
	if len(k.connects) != 0 || len(nbdRecordFiles(t, records)) != 0 {
		t.Fatalf("refused requests reached the kernel (%v) or left records (%v)", k.connects, nbdRecordFiles(t, records))
	}

	// Someone else's device is nbd0: the kernel picks nbd1.
	k.set(0, "rbd-nbd:pool/img")
	dev, err := n.ConnectNBD(ctx, req, streamSocket(t))
	if err != nil {
		t.Fatal(err)
	}
	if dev != (Device{Path: "/dev/nbd1", Major: 43, Minor: 32}) {
		t.Fatalf("device %+v, want /dev/nbd1 43:32", dev)
	}
	if c := k.connects[0]; c.Index != -1 || c.Backend != req.Backend || c.SizeBytes != req.SizeBytes || c.BlockSize != 4096 ||
		c.DeadConnTimeout != 2*time.Minute || c.ServerFlags != req.ServerFlags {
		t.Fatalf("the kernel was asked %+v", c)
	}
	files := nbdRecordFiles(t, records)
	if len(files) != 1 {
		t.Fatalf("records %v, want 1", files)
	}
	var rec nbdRecord
	if b, err := os.ReadFile(files[0]); err != nil || json.Unmarshal(b, &rec) != nil || rec.Index != 1 || rec.Backend != req.Backend || rec.Boot == "" {
		t.Fatalf("record %+v (%v)", rec, err)
	}
	if st, err := os.Stat(filepath.Join(records, "nbd")); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("records dir: %v %v, want mode 0700", st.Mode(), err)
	}
	if !n.ownsNBD(43, 32) {
		t.Fatal("the device the mounter connected is not accepted")
	}
	for _, d := range [][2]uint32{{43, 0}, {43, 33}, {43, 64}, {7, 32}} {
		if n.ownsNBD(d[0], d[1]) {
			t.Fatalf("%d:%d accepted: another driver's device, a partition, a free device, a loop device", d[0], d[1])
		}
	}
	wantNBDErr(t, "the same backend again", func() error { _, err := n.ConnectNBD(ctx, req, streamSocket(t)); return err }(), errdefs.ErrAlreadyExists)
	forged := with(func(r *NBDRequest) { r.Backend = backendFor(t, "vol-b") })
	k.set(5, forged.Backend)
	wantNBDErr(t, "a backend the kernel shows on a device the mounter did not connect", func() error { _, err := n.ConnectNBD(ctx, forged, streamSocket(t)); return err }(), errdefs.ErrAlreadyExists)
	if n.ownsNBD(43, 5*32) {
		t.Fatal("a device carrying mountplan's form of backend, not connected by the mounter, is accepted")
	}
	k.set(5, "")

	// The kernel fails: nothing recorded.
	k.failConnect = fmt.Errorf("nbdnl: connect: no NBD device left: %w", errdefs.ErrResourceExhausted)
	wantNBDErr(t, "a failing kernel", func() error { _, err := n.ConnectNBD(ctx, forged, streamSocket(t)); return err }(), errdefs.ErrResourceExhausted)
	k.failConnect = nil
	if len(nbdRecordFiles(t, records)) != 1 {
		t.Fatalf("a failed connect left a record: %v", nbdRecordFiles(t, records))
	}

	// Reconnect: only the recorded device, by its backend.
	wantNBDErr(t, "reconnect without a socket", n.ReconnectNBD(ctx, dev, req.Backend, nil), errdefs.ErrInvalidArgument)
	wantNBDErr(t, "reconnect of another device", n.ReconnectNBD(ctx, Device{Path: "/dev/nbd0", Major: 43}, req.Backend, streamSocket(t)), errdefs.ErrPermissionDenied)
	wantNBDErr(t, "reconnect of another driver's device", n.ReconnectNBD(ctx, Device{Path: "/dev/nbd0", Major: 43}, "rbd-nbd:pool/img", streamSocket(t)), errdefs.ErrInvalidArgument)
	wantNBDErr(t, "reconnect of a backend never connected", n.ReconnectNBD(ctx, Device{}, forged.Backend, streamSocket(t)), errdefs.ErrNotFound)
	if err := n.ReconnectNBD(ctx, dev, req.Backend, streamSocket(t)); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(k.reconfigs) != fmt.Sprintf("[nbd1 %s 1]", req.Backend) {
		t.Fatalf("reconfigures %v", k.reconfigs)
	}

	// Disconnect: another device or backend is never touched.
	wantNBDErr(t, "disconnect naming another device", n.DisconnectNBD(ctx, Device{Path: "/dev/nbd0", Major: 43}, req.Backend), errdefs.ErrPermissionDenied)
	if err := n.DisconnectNBD(ctx, Device{}, forged.Backend); err != nil {
		t.Fatalf("disconnect of a backend never connected: %v", err)
	}
	wantNBDErr(t, "disconnect of another driver's backend", n.DisconnectNBD(ctx, Device{}, "rbd-nbd:pool/img"), errdefs.ErrInvalidArgument)
	if len(k.disconnects) != 0 || k.Backend(0) != "rbd-nbd:pool/img" {
		t.Fatalf("refused disconnects reached the kernel: %v", k.disconnects)
	}
	if err := n.DisconnectNBD(ctx, Device{}, req.Backend); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(k.disconnects) != "[1]" || n.ownsNBD(43, 32) || len(nbdRecordFiles(t, records)) != 0 {
		t.Fatalf("after disconnect: kernel disconnects %v, owned %v, records %v", k.disconnects, n.ownsNBD(43, 32), nbdRecordFiles(t, records))
	}
	if err := n.DisconnectNBD(ctx, dev, req.Backend); err != nil {
		t.Fatalf("second disconnect: %v", err)
	}
}

// TestNBDRecordsAcrossRestarts: a new mounter holds the devices the kernel
// still shows with their backends, completes a connect its predecessor
// died in, and drops what is gone, of another boot, or disconnected
// behind its back. One that observes writes nothing and connects nothing.
func TestNBDRecordsAcrossRestarts(t *testing.T) {
	k := newFakeNBD()
	state, records := t.TempDir(), t.TempDir()
	o := Options{StateDir: state, RecordsDir: records}
	n := nbdNode(t, k, o)
	ctx := context.Background()
	connect := func(id string) (Device, string) {
		t.Helper()
		b := backendFor(t, id)
		d, err := n.ConnectNBD(ctx, NBDRequest{SizeBytes: 1 << 30, Backend: b}, streamSocket(t))
		if err != nil {
			t.Fatal(err)
		}
		return d, b
	}
	kept, keptBackend := connect("kept")
	gone, _ := connect("gone")
	oldBoot, _ := connect("old-boot")
	n.Close()

	k.set(int(gone.Minor/32), "") // disconnected behind the mounter's back
	// The previous boot's record: edit its boot.
	for _, f := range nbdRecordFiles(t, records) {
		b, _ := os.ReadFile(f)
		var rec nbdRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Index == int(oldBoot.Minor/32) {
			rec.Boot = "another-boot"
			b, _ = json.Marshal(rec)
			if err := os.WriteFile(f, b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	// A connect the last mounter died in: the record says index -1, the
	// kernel has the device.
	pending := nbdRecord{Backend: backendFor(t, "pending"), Index: -1, SizeBytes: 1 << 30, Boot: n.records.boot}
	if err := n.nbd.db.Put(nbdKey(pending.Backend), pending); err != nil {
		t.Fatal(err)
	}
	k.set(9, pending.Backend)
	// And one that never reached the kernel.
	lost := nbdRecord{Backend: backendFor(t, "lost"), Index: -1, Boot: n.records.boot}
	if err := n.nbd.db.Put(nbdKey(lost.Backend), lost); err != nil {
		t.Fatal(err)
	}

	// An observer first: reads this boot's records as they are.
	obs := nbdNode(t, k, Options{StateDir: state, RecordsDir: records, Observe: true})
	if !obs.ownsNBD(kept.Major, kept.Minor) || obs.ownsNBD(gone.Major, gone.Minor) {
		t.Fatal("the observer does not see the records as the kernel shows them")
	}
	if _, err := obs.ConnectNBD(ctx, NBDRequest{SizeBytes: 1 << 20, Backend: backendFor(t, "x")}, streamSocket(t)); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("an observer connected: %v", err)
	}
	wantNBDErr(t, "an observer disconnecting", obs.DisconnectNBD(ctx, kept, keptBackend), errdefs.ErrFailedPrecondition)
	if got := len(nbdRecordFiles(t, records)); got != 5 {
		t.Fatalf("the observer changed the records: %d files, want 5", got)
	}

	n2 := nbdNode(t, k, o)
	if !n2.ownsNBD(kept.Major, kept.Minor) || !n2.ownsNBD(43, 9*32) {
		t.Fatal("the restarted mounter does not hold the devices still connected with their backends")
	}
	if n2.ownsNBD(gone.Major, gone.Minor) || n2.ownsNBD(oldBoot.Major, oldBoot.Minor) {
		t.Fatal("the restarted mounter holds a device disconnected behind its back, or one of another boot's record")
	}
	if got := len(nbdRecordFiles(t, records)); got != 2 {
		t.Fatalf("records after the restart: %d, want 2 (kept, pending)", got)
	}
	if err := n2.DisconnectNBD(ctx, kept, keptBackend); err != nil {
		t.Fatal(err)
	}
	if err := n2.DisconnectNBD(ctx, Device{}, pending.Backend); err != nil {
		t.Fatal(err)
	}
	if len(nbdRecordFiles(t, records)) != 0 || k.Backend(9) != "" {
		t.Fatal("records or devices left")
	}

	// An observer over records that were never made: nothing trusted.
	empty := nbdNode(t, k, Options{StateDir: t.TempDir(), RecordsDir: filepath.Join(t.TempDir(), "none"), Observe: true})
	if empty.ownsNBD(kept.Major, kept.Minor) {
		t.Fatal("an observer without records trusts a device")
	}
}
