package nbd

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/bytesrvtest"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
)

// Transmission requests, as the kernel sends them (doc/proto.md).
const (
	requestMagic    = 0x25609513
	simpleReplyMagc = 0x67446698
	cmdRead         = 0
	cmdWrite        = 1
	cmdDisc         = 2
	txFlagHasFlags  = 1 << 0
)

// txConn speaks transmission over a Transmission's Socket, as the kernel
// would, with a deadline so that a wrong phase fails instead of hanging.
type txConn struct {
	t      *testing.T
	c      net.Conn
	handle uint64
}

func newTxConn(t *testing.T, tr *Transmission) *txConn {
	t.Helper()
	c, err := net.FileConn(tr.Socket) // a duplicate: Close of tr still closes ours
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &txConn{t: t, c: c}
}

func (x *txConn) request(typ uint16, off uint64, length uint32, data []byte) {
	x.t.Helper()
	x.handle++
	b := binary.BigEndian.AppendUint32(nil, requestMagic)
	b = binary.BigEndian.AppendUint16(b, 0)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, x.handle)
	b = binary.BigEndian.AppendUint64(b, off)
	b = binary.BigEndian.AppendUint32(b, length)
	if _, err := x.c.Write(append(b, data...)); err != nil {
		x.t.Fatalf("sending command %d: %v", typ, err)
	}
}

// reply reads a simple reply and n bytes of data after it.
func (x *txConn) reply(n int) []byte {
	x.t.Helper()
	b := make([]byte, 16+n)
	if _, err := io.ReadFull(x.c, b); err != nil {
		x.t.Fatalf("reading the reply to request %d: %v", x.handle, err)
	}
	if m, e, h := binary.BigEndian.Uint32(b), binary.BigEndian.Uint32(b[4:]), binary.BigEndian.Uint64(b[8:]); m != simpleReplyMagc || e != 0 || h != x.handle {
		x.t.Fatalf("reply magic %#x error %d handle %d, want %#x 0 %d", m, e, h, simpleReplyMagc, x.handle)
	}
	return b[16:]
}

// writeReadDisc writes a block at off, reads it back and disconnects
// (NBD_CMD_DISC): proof that the socket is in transmission.
func writeReadDisc(t *testing.T, tr *Transmission, off uint64) []byte {
	t.Helper()
	x := newTxConn(t, tr)
	want := bytes.Repeat([]byte("mountplan negotiate "), 4096/20+1)[:4096]
	x.request(cmdWrite, off, uint32(len(want)), want)
	x.reply(0)
	x.request(cmdRead, off, uint32(len(want)), nil)
	if got := x.reply(len(want)); !bytes.Equal(got, want) {
		t.Fatalf("read back %q..., want %q...", got[:32], want[:32])
	}
	x.request(cmdDisc, 0, 0, nil)
	x.c.Close()
	return want
}

// checkExport checks what Negotiate learnt of a writable export of size.
func checkExport(t *testing.T, tr *Transmission, size int64) {
	t.Helper()
	if !tr.Export.Known || tr.Export.Size != size || tr.Export.ReadOnly || tr.Flags&txFlagHasFlags == 0 || tr.Socket == nil {
		t.Fatalf("transmission %+v (flags %#x), want a writable export of %d bytes", tr, tr.Flags, size)
	}
}

func fileAt(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestNegotiatePlain: over TCP and a unix socket, the socket handed out is
// the connection itself, in transmission, and the data reaches the export.
func TestNegotiatePlain(t *testing.T) {
	dir := t.TempDir()
	path := nbdtest.AddExport(t, dir, "disk", 16<<20)
	tcp := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	unixSrv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{Unix: filepath.Join(t.TempDir(), "nbd.sock")})
	for i, d := range []Dialer{{Network: "tcp", Address: tcp.Address}, {Network: "unix", Address: unixSrv.Socket}} {
		t.Run(d.Network, func(t *testing.T) {
			start := time.Now()
			tr, err := d.Negotiate(t.Context(), "disk")
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			t.Logf("negotiated in %v: size %d flags %#x block sizes %d/%d/%d", time.Since(start), tr.Export.Size, tr.Flags, tr.MinBlockSize, tr.BlockSize, tr.MaxBlockSize)
			checkExport(t, tr, 16<<20)
			if tr.Proxied() || tr.Done() != nil || tr.Wait() != nil {
				t.Fatal("a plain connection has a proxy")
			}
			if fl, err := fcntlFlags(tr.Socket); err != nil || fl&unix.O_ACCMODE != unix.O_RDWR || fl&unix.O_NONBLOCK != 0 {
				t.Fatalf("socket flags %#x, %v: want a blocking read-write socket", fl, err)
			}
			off := uint64(1<<20) * uint64(i+1)
			want := writeReadDisc(t, tr, off)
			if got := fileAt(t, path, int64(off), len(want)); !bytes.Equal(got, want) {
				t.Fatal("the write did not reach the export's file")
			}
		})
	}
}

// TestNegotiateReadOnly: a read-only export says so in its flags.
func TestNegotiateReadOnly(t *testing.T) {
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "ro", 4<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{ReadOnly: true})
	tr, err := Dialer{Network: "tcp", Address: srv.Address}.Negotiate(t.Context(), "ro")
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if !tr.Export.ReadOnly || tr.Flags&txFlagReadOnly == 0 {
		t.Fatalf("read-only export: %+v flags %#x", tr.Export, tr.Flags)
	}
}

func TestNegotiateMissingExport(t *testing.T) {
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "disk", 4<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	_, err := Dialer{Network: "tcp", Address: srv.Address}.Negotiate(t.Context(), "nope")
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Negotiate(nope) = %v, want NotFound", err)
	}
}

// testTLS starts a TLS-only nbdkit and returns it with a client config.
func testTLS(t *testing.T, dir string) (*nbdtest.Server, *tls.Config) {
	t.Helper()
	tlsDir := t.TempDir()
	caFile := writeTLSFiles(t, tlsDir)
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{TLSDir: tlsDir})
	return srv, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
}

// TestNegotiateTLS: the socket is a socketpair end proxied to the TLS
// connection; transmission works through it; the proxy tells which side
// ended it; Close leaves no goroutine and no descriptor behind.
func TestNegotiateTLS(t *testing.T) {
	dir := t.TempDir()
	path := nbdtest.AddExport(t, dir, "secure", 16<<20)
	srv, cfg := testTLS(t, dir)
	d := Dialer{Network: "tcp", Address: srv.Address, TLS: cfg}
	if _, err := (Dialer{Network: "tcp", Address: srv.Address}).Negotiate(t.Context(), "secure"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("plain Negotiate with a TLS-only server = %v, want FailedPrecondition", err)
	}
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)

	start := time.Now()
	tr, err := d.Negotiate(t.Context(), "secure")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("negotiated over TLS in %v", time.Since(start))
	checkExport(t, tr, 16<<20)
	if !tr.Proxied() {
		t.Fatal("TLS transmission without a proxy")
	}
	if sa, err := getsockname(tr.Socket); err != nil || sa != "unix" {
		t.Fatalf("socket is %q (%v), want a unix socketpair end", sa, err)
	}
	want := writeReadDisc(t, tr, 3<<20)
	if got := fileAt(t, path, 3<<20, len(want)); !bytes.Equal(got, want) {
		t.Fatal("the write did not reach the export's file")
	}
	// NBD_CMD_DISC makes the server close: the proxy sees its side end.
	select {
	case <-tr.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("proxy still running after NBD_CMD_DISC")
	}
	if err := tr.Wait(); !errors.Is(err, ErrServerSideClosed) {
		t.Fatalf("Wait after the server closed = %v", err)
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	waitSettled(t, goroutines, fds)

	// The kernel's side closing (here: every copy of Socket) ends it too.
	tr, err = d.Negotiate(t.Context(), "secure")
	if err != nil {
		t.Fatal(err)
	}
	tr.Socket.Close()
	if err := tr.Wait(); !errors.Is(err, ErrKernelSideClosed) {
		t.Fatalf("Wait after the kernel side closed = %v", err)
	}
	tr.Close()

	// Close of a running proxy: nil from Wait, nothing left behind.
	tr, err = d.Negotiate(t.Context(), "secure")
	if err != nil {
		t.Fatal(err)
	}
	x := newTxConn(t, tr)
	x.request(cmdRead, 0, 512, nil)
	x.reply(512)
	if err := tr.Close(); err != nil || tr.Wait() != nil {
		t.Fatalf("Close = %v, Wait = %v", err, tr.Wait())
	}
	x.c.Close()
	waitSettled(t, goroutines, fds)
}

// noGoFront sits in front of an NBD server as an old server would: it
// answers NBD_OPT_GO with NBD_REP_ERR_UNSUP and passes everything else on.
// With hideNoZeroes it also hides the server's NO_ZEROES flag, so that the
// server sends the 124 zero bytes after EXPORT_NAME's reply.
func noGoFront(t *testing.T, backend string, hideNoZeroes bool) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serveNoGo(c, backend, hideNoZeroes)
		}
	}()
	return l.Addr().String()
}

func serveNoGo(c net.Conn, backend string, hideNoZeroes bool) {
	defer c.Close()
	b, err := net.Dial("tcp", backend)
	if err != nil {
		return
	}
	defer b.Close()
	hello := make([]byte, greetingLength)
	if _, err := io.ReadFull(b, hello); err != nil {
		return
	}
	if hideNoZeroes {
		binary.BigEndian.PutUint16(hello[16:], binary.BigEndian.Uint16(hello[16:])&^flagNoZeroes)
	}
	if _, err := c.Write(hello); err != nil {
		return
	}
	go func() { _, _ = io.Copy(c, b); c.Close() }() // the server's replies, then transmission; its hang-up
	clientFlags := make([]byte, 4)
	if _, err := io.ReadFull(c, clientFlags); err != nil {
		return
	}
	_, _ = b.Write(clientFlags)
	for {
		hdr := make([]byte, 16)
		if _, err := io.ReadFull(c, hdr); err != nil {
			return
		}
		opt := binary.BigEndian.Uint32(hdr[8:])
		data := make([]byte, binary.BigEndian.Uint32(hdr[12:]))
		if _, err := io.ReadFull(c, data); err != nil {
			return
		}
		if opt == optGo {
			_, _ = c.Write(replyBytes(optGo, repErrUnsup, nil))
			continue
		}
		_, _ = b.Write(append(hdr, data...))
		if opt == optExportName {
			_, _ = io.Copy(b, c)
			return
		}
	}
}

// TestNegotiateExportName: a server that refuses GO is entered with
// EXPORT_NAME, with and without the zero padding; a missing export there
// is NotFound too (the server just hangs up).
func TestNegotiateExportName(t *testing.T) {
	dir := t.TempDir()
	path := nbdtest.AddExport(t, dir, "old", 8<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	for i, hide := range []bool{false, true} {
		d := Dialer{Network: "tcp", Address: noGoFront(t, srv.Address, hide), Timeout: 5 * time.Second}
		tr, err := d.Negotiate(t.Context(), "old")
		if err != nil {
			t.Fatalf("zero padding %v: %v", hide, err)
		}
		checkExport(t, tr, 8<<20)
		if tr.BlockSize != 0 {
			t.Fatalf("EXPORT_NAME cannot tell block sizes, got %d", tr.BlockSize)
		}
		off := uint64(i+1) << 20
		want := writeReadDisc(t, tr, off)
		tr.Close()
		if got := fileAt(t, path, int64(off), len(want)); !bytes.Equal(got, want) {
			t.Fatal("the write did not reach the export's file")
		}
		if _, err := d.Negotiate(t.Context(), "nope"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("EXPORT_NAME of a missing export = %v, want NotFound", err)
		}
	}
}

// TestNegotiateScripted plays servers that answer GO in ways nbdkit does not.
func TestNegotiateScripted(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := bytesrvtest.Serve(t, l)
	d := Dialer{Network: "unix", Address: sock, Timeout: 2 * time.Second}
	blockInfo := func(min, pref, max uint32) []byte {
		b := binary.BigEndian.AppendUint16(nil, infoBlockSize)
		b = binary.BigEndian.AppendUint32(b, min)
		b = binary.BigEndian.AppendUint32(b, pref)
		return binary.BigEndian.AppendUint32(b, max)
	}
	for _, tc := range []struct {
		name    string
		server  []byte
		wantErr error
		check   func(*Transmission) bool
	}{
		{"policy", serverBytes(flagFixedNew, replyBytes(optGo, repErrPolicy, []byte("go away\x1b[2J"))), errdefs.ErrPermissionDenied, nil},
		{"tls required", serverBytes(flagFixedNew, replyBytes(optGo, repErrTLSReqd, nil)), errdefs.ErrFailedPrecondition, nil},
		{"ack without size", serverBytes(flagFixedNew, replyBytes(optGo, repAck, nil)), errdefs.ErrUnavailable, nil},
		{"huge size", serverBytes(flagFixedNew, replyBytes(optGo, repInfo, infoBytes(1<<63, 1))), errdefs.ErrUnavailable, nil},
		{"oversized reply", serverBytes(flagFixedNew, binary.BigEndian.AppendUint32(replyBytes(optGo, repInfo, nil)[:16], maxReplyLength+1)), errdefs.ErrUnavailable, nil},
		{"unsupported, then hangs up", serverBytes(flagFixedNew, replyBytes(optGo, repErrUnsup, nil)), errdefs.ErrNotFound, nil},
		{"unsupported, short export reply", serverBytes(flagFixedNew|flagNoZeroes, replyBytes(optGo, repErrUnsup, nil), []byte{0, 0, 0}), errdefs.ErrUnavailable, nil},
		{"data before any request", serverBytes(flagFixedNew, replyBytes(optGo, repInfo, infoBytes(1<<20, 1)), replyBytes(optGo, repAck, nil), []byte("junk")), errdefs.ErrUnavailable, nil},
		{"block sizes", serverBytes(flagFixedNew, replyBytes(optGo, repInfo, infoBytes(1<<20, 1)), replyBytes(optGo, repInfo, blockInfo(512, 4096, 1<<25)), replyBytes(optGo, repAck, nil)), nil,
			func(t *Transmission) bool {
				return t.MinBlockSize == 512 && t.BlockSize == 4096 && t.MaxBlockSize == 1<<25
			}},
		{"nonsense block sizes", serverBytes(flagFixedNew, replyBytes(optGo, repInfo, infoBytes(1<<20, 1)), replyBytes(optGo, repInfo, blockInfo(3, 4096, 512)), replyBytes(optGo, repAck, nil)), nil,
			func(t *Transmission) bool { return t.BlockSize == 0 && t.MinBlockSize == 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv.Set(tc.server)
			start := time.Now()
			tr, err := d.Negotiate(context.Background(), "disk")
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("Negotiate = %v, want %v", err, tc.wantErr)
				}
				if err != nil && strings.Contains(err.Error(), "\x1b") {
					t.Fatalf("the error shows the server's raw bytes: %q", err)
				}
				if time.Since(start) > time.Second {
					t.Fatalf("took %v: a failure must not wait for the deadline", time.Since(start))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			if !tc.check(tr) {
				t.Fatalf("transmission %+v", tr)
			}
		})
	}
}

// TestNegotiateBounded: a server that greets and then says nothing holds
// Negotiate for Dialer.Timeout at most, and a cancelled ctx ends it at once.
func TestNegotiateBounded(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write(serverBytes(flagFixedNew))
			go func() { _, _ = io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	d := Dialer{Network: "tcp", Address: l.Addr().String(), Timeout: 300 * time.Millisecond}
	start := time.Now()
	if _, err := d.Negotiate(context.Background(), "x"); !errors.Is(err, errdefs.ErrUnavailable) || time.Since(start) > 2*time.Second {
		t.Fatalf("Negotiate with a silent server = %v after %v", err, time.Since(start))
	}
	d.Timeout = time.Minute
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	start = time.Now()
	if _, err := d.Negotiate(ctx, "x"); err == nil || time.Since(start) > 2*time.Second {
		t.Fatalf("Negotiate with a cancelled ctx = %v after %v", err, time.Since(start))
	}
}

// FuzzNegotiate plays a server that sends the fuzzer's bytes: Negotiate
// must not panic, hang past its timeout, or fail without a sentinel.
func FuzzNegotiate(f *testing.F) {
	f.Add(serverBytes(flagFixedNew|flagNoZeroes, replyBytes(optGo, repInfo, infoBytes(1<<30, 1)), replyBytes(optGo, repAck, nil)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optGo, repErrUnsup, nil), binary.BigEndian.AppendUint64(nil, 1<<20), []byte{0, 1}, make([]byte, exportNamePad)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optGo, repErrUnknown, []byte("no"))))
	sock := filepath.Join(f.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		f.Fatal(err)
	}
	srv := bytesrvtest.Serve(f, l)
	d := Dialer{Network: "unix", Address: sock, Timeout: 2 * time.Second}
	f.Fuzz(func(t *testing.T, data []byte) {
		srv.Set(data)
		tr, err := d.Negotiate(context.Background(), "disk")
		checkErr(t, "Negotiate", err)
		if err == nil {
			if tr.Export.Size < 0 || tr.Socket == nil {
				t.Fatalf("transmission %+v", tr)
			}
			tr.Close()
		}
	})
}

func fcntlFlags(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var fl int
	var ferr error
	if err := rc.Control(func(fd uintptr) { fl, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) }); err != nil {
		return 0, err
	}
	return fl, ferr
}

// getsockname names the family of f's socket.
func getsockname(f *os.File) (string, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return "", err
	}
	var sa unix.Sockaddr
	var serr error
	if err := rc.Control(func(fd uintptr) { sa, serr = unix.Getsockname(int(fd)) }); err != nil {
		return "", err
	}
	switch sa.(type) {
	case *unix.SockaddrUnix:
		return "unix", serr
	case *unix.SockaddrInet4, *unix.SockaddrInet6:
		return "inet", serr
	}
	return "other", serr
}

func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// waitSettled waits until no more goroutines and descriptors are left
// than before (the runtime ends goroutines a moment after they return).
func waitSettled(t *testing.T, goroutines, fds int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		g, n := runtime.NumGoroutine(), openFDs(t)
		if g <= goroutines && n <= fds {
			t.Logf("settled: %d goroutines (before: %d), %d descriptors (before: %d)", g, goroutines, n, fds)
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("left behind: %d goroutines (before: %d), %d descriptors (before: %d)\n%s", g, goroutines, n, fds, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
}
