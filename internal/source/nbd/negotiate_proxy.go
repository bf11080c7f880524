package nbd

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Why a TLS proxy stopped (Transmission.Wait), besides Close.
var (
	// ErrKernelSideClosed: the socketpair's other end closed, which is the
	// kernel letting the device go (or the caller closing a Socket it never
	// handed over).
	ErrKernelSideClosed = errors.New("the kernel's end of the NBD socket closed")
	// ErrServerSideClosed: the server or the network ended the TLS
	// connection; the kernel sees its socket die too.
	ErrServerSideClosed = errors.New("the NBD server's TLS connection ended")
)

// proxyBuffer is one read's worth each way; the kernel's requests are
// split across reads of any size.
const proxyBuffer = 128 << 10

// proxy copies both ways between the kernel's socketpair end (through
// local, the other end) and the TLS connection, until either side closes
// or stop is called.
type proxy struct {
	server, local net.Conn
	done          chan struct{} // closed once both copies have returned
	running       atomic.Int32
	once          sync.Once
	err           error // why it stopped; read only after done
}

// handOverProxied makes the socketpair, gives one end to t and proxies the
// other: the kernel speaks plain NBD, the server TLS.
func (s *session) handOverProxied(t *Transmission) error {
	fail := func(err error) error {
		_ = s.conn.Close()
		return fmt.Errorf("NBD server %s: setting up the TLS proxy: %w: %w", s.name, err, errdefs.ErrUnavailable)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	// The kernel's end stays in blocking mode; ours goes to Go's poller
	// (net.FileConn takes a duplicate of it).
	kernelEnd, ourEnd := os.NewFile(uintptr(pair[0]), "nbd-tls:"+s.name), os.NewFile(uintptr(pair[1]), "nbd-tls-proxy")
	local, err := net.FileConn(ourEnd)
	ourEnd.Close()
	if err != nil {
		kernelEnd.Close()
		return fail(err)
	}
	_ = s.conn.SetDeadline(time.Time{}) // the handshake's bound does not apply to transmission
	t.Socket = kernelEnd
	t.proxy = startProxy(s.conn, s.r, local)
	return nil
}

// startProxy runs the two copies; fromServer reads server (through the
// handshake's buffer).
func startProxy(server net.Conn, fromServer io.Reader, local net.Conn) *proxy {
	p := &proxy{server: server, local: local, done: make(chan struct{})}
	p.running.Store(2)
	go p.pipe(local, fromServer, ErrServerSideClosed, ErrKernelSideClosed)
	go p.pipe(server, local, ErrKernelSideClosed, ErrServerSideClosed)
	return p
}

// pipe copies src to dst; the side that failed first is why the proxy stops.
func (p *proxy) pipe(dst io.Writer, src io.Reader, srcEnded, dstEnded error) {
	defer func() {
		if p.running.Add(-1) == 0 {
			close(p.done)
		}
	}()
	buf := make([]byte, proxyBuffer)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				p.stop(fmt.Errorf("%w: %w: %w", dstEnded, werr, errdefs.ErrUnavailable))
				return
			}
		}
		if err != nil {
			p.stop(fmt.Errorf("%w: %w: %w", srcEnded, err, errdefs.ErrUnavailable))
			return
		}
	}
}

// stop records why (the first caller wins; nil is Close) and closes both
// connections, which ends both copies.
func (p *proxy) stop(why error) {
	p.once.Do(func() {
		p.err = why
		_ = p.local.Close()
		_ = p.server.Close()
	})
}
