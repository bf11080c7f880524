package nbd

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/dial"
)

// The end of the fixed-newstyle handshake: entering transmission, so that
// the socket can be handed to the kernel (internal/nbdnl). The plugin does this
// unprivileged; only the hand-over needs the mounter.
const (
	optExportName  = 1
	optGo          = 7
	infoBlockSize  = 3
	maxExportName  = 4096 // the protocol's limit on a name
	exportNamePad  = 124  // zero bytes after NBD_OPT_EXPORT_NAME's reply, unless NO_ZEROES
	greetingLength = 18
)

// errGoUnsupported is the server's NBD_REP_ERR_UNSUP to NBD_OPT_GO.
var errGoUnsupported = errors.New("NBD_OPT_GO unsupported")

// Transmission is a connection in the transmission phase of one export.
type Transmission struct {
	Export Export
	// Flags are the transmission flags (NBD_FLAG_HAS_FLAGS, READ_ONLY,
	// SEND_FLUSH, ...), for the kernel's NBD_ATTR_SERVER_FLAGS.
	Flags uint16
	// BlockSize is the server's preferred block size; MinBlockSize and
	// MaxBlockSize its limits. All 0 when the server did not say
	// (NBD_INFO_BLOCK_SIZE is optional; EXPORT_NAME never says).
	BlockSize, MinBlockSize, MaxBlockSize uint32
	// Socket is the descriptor to hand to the kernel: the connection
	// itself, or with TLS one end of a socketpair whose other end this
	// process proxies (the kernel cannot speak TLS). It is in blocking
	// mode, as the kernel's nbd expects. Whoever passes it on
	// may close it then; Close closes it too.
	Socket *os.File

	proxy *proxy
}

// Proxied reports whether a proxy in this process carries the bytes (TLS):
// the connection then lives only as long as this process and t.
func (t *Transmission) Proxied() bool { return t.proxy != nil }

// Done is closed when the proxy has stopped: the kernel's end or the
// server's closed, or Close was called. Nil without a proxy (nothing runs
// here: the kernel owns the socket), which blocks forever in a select.
func (t *Transmission) Done() <-chan struct{} {
	if t.proxy == nil {
		return nil
	}
	return t.proxy.done
}

// Wait waits for the proxy to stop and says why: nil after Close, else an
// error wrapping ErrKernelSideClosed or ErrServerSideClosed. Without a
// proxy it returns nil at once.
func (t *Transmission) Wait() error {
	if t.proxy == nil {
		return nil
	}
	<-t.proxy.done
	return t.proxy.err
}

// Close closes Socket, if still open, and stops the proxy, waiting for its
// goroutines. The kernel's own reference to a socket it was given lives on:
// a plain connection stays up; a proxied one ends here.
func (t *Transmission) Close() error {
	var err error
	if t.Socket != nil {
		if cerr := t.Socket.Close(); cerr != nil && !errors.Is(cerr, os.ErrClosed) {
			err = cerr
		}
	}
	if t.proxy != nil {
		t.proxy.stop(nil)
		<-t.proxy.done
	}
	return err
}

// Negotiate performs the whole handshake for export, STARTTLS first when
// d.TLS is set, and enters transmission with NBD_OPT_GO (or
// NBD_OPT_EXPORT_NAME when the server does not know GO). Errors are those
// of Probe: NotFound, FailedPrecondition (TLS required), PermissionDenied,
// Unavailable. The exchange is bounded by d.Timeout and ctx.
func (d Dialer) Negotiate(ctx context.Context, export string) (*Transmission, error) {
	if len(export) > maxExportName {
		return nil, fmt.Errorf("NBD export name of %d bytes (at most %d): %w", len(export), maxExportName, errdefs.ErrInvalidArgument)
	}
	s, noZeroes, err := d.openForTransmission(ctx)
	if err != nil {
		return nil, err
	}
	// A cancelled ctx ends a blocked read at once, not at the deadline.
	stop := context.AfterFunc(ctx, func() { _ = s.conn.SetDeadline(time.Now()) })
	t, err := s.enter(export, noZeroes)
	if !stop() {
		err = fmt.Errorf("NBD server %s: negotiation ended: %w", s.name, context.Cause(ctx))
	}
	if err != nil {
		s.abandon(err)
		return nil, err
	}
	if err := s.handOver(t); err != nil {
		return nil, err
	}
	return t, nil
}

// openForTransmission is open, but remembers whether the server sends the
// 124 zero bytes after an EXPORT_NAME reply: greet answers the server's
// NO_ZEROES flag without telling, so the greeting is peeked first.
func (d Dialer) openForTransmission(ctx context.Context) (*session, bool, error) {
	conn, deadline, err := dial.Conn(ctx, d.Network, d.Address, d.Timeout, "NBD server "+d.String())
	if err != nil {
		return nil, false, err
	}
	s := &session{conn: conn, r: bufio.NewReader(conn), name: d.String()}
	hello, _ := s.r.Peek(greetingLength) // a short greeting fails in greet
	noZeroes := len(hello) == greetingLength && binary.BigEndian.Uint16(hello[16:])&flagNoZeroes != 0
	if err := s.greet(); err != nil {
		conn.Close()
		return nil, false, err
	}
	if d.TLS != nil {
		if err := s.startTLS(d.TLS); err != nil {
			conn.Close()
			return nil, false, err
		}
		_ = s.conn.SetDeadline(deadline)
	}
	return s, noZeroes, nil
}

// abandon ends a failed negotiation: politely (NBD_OPT_ABORT) after a
// refusal, when the server still haggles; at once after a broken exchange,
// where waiting for an answer would only wait for the deadline.
func (s *session) abandon(err error) {
	if errors.Is(err, errdefs.ErrUnavailable) {
		_ = s.conn.Close()
		return
	}
	s.close()
}

// enter asks for transmission with GO, or EXPORT_NAME on an old server.
func (s *session) enter(export string, noZeroes bool) (*Transmission, error) {
	t, err := s.optGo(export)
	if errors.Is(err, errGoUnsupported) {
		return s.exportName(export, noZeroes)
	}
	return t, err
}

func (s *session) optGo(export string) (*Transmission, error) {
	data := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	data = append(data, export...)
	data = binary.BigEndian.AppendUint16(data, 2)
	data = binary.BigEndian.AppendUint16(data, infoExport)
	data = binary.BigEndian.AppendUint16(data, infoBlockSize)
	if err := s.send(optGo, data); err != nil {
		return nil, err
	}
	t := &Transmission{}
	what := fmt.Sprintf("export %q", export)
	for {
		r, err := s.recv(optGo)
		if err != nil {
			return nil, err
		}
		switch {
		case r.typ == repAck:
			if !t.Export.Known {
				return nil, fmt.Errorf("NBD server %s entered transmission of %s without saying its size: %w", s.name, what, errdefs.ErrUnavailable)
			}
			return t, nil
		case r.typ == repInfo:
			if err := s.info(t, r.data, what); err != nil {
				return nil, err
			}
		case r.typ == repErrUnsup:
			return nil, errGoUnsupported
		case r.typ&repErr != 0:
			return nil, s.replyError(r, what)
		}
	}
}

// info reads one NBD_REP_INFO into t; kinds it did not ask for are skipped.
func (s *session) info(t *Transmission, b []byte, what string) error {
	if len(b) < 2 {
		return fmt.Errorf("NBD server %s sent an empty info reply for %s: %w", s.name, what, errdefs.ErrUnavailable)
	}
	switch binary.BigEndian.Uint16(b) {
	case infoExport:
		if len(b) < 12 {
			return fmt.Errorf("NBD server %s sent a short export info for %s: %w", s.name, what, errdefs.ErrUnavailable)
		}
		return s.setExport(t, binary.BigEndian.Uint64(b[2:]), binary.BigEndian.Uint16(b[10:]), what)
	case infoBlockSize:
		if len(b) >= 14 {
			setBlockSizes(t, binary.BigEndian.Uint32(b[2:]), binary.BigEndian.Uint32(b[6:]), binary.BigEndian.Uint32(b[10:]))
		}
	}
	return nil
}

func (s *session) setExport(t *Transmission, size uint64, flags uint16, what string) error {
	if size > math.MaxInt64 {
		return fmt.Errorf("NBD server %s reports a size of %d bytes for %s: %w", s.name, size, what, errdefs.ErrUnavailable)
	}
	t.Export = Export{Size: int64(size), ReadOnly: flags&txFlagReadOnly != 0, Known: true}
	t.Flags = flags
	return nil
}

// setBlockSizes keeps the server's block sizes only when they make sense
// (powers of two, min <= preferred <= max): the kernel's block size is
// chosen from them, and a server that cannot say them right is treated as
// one that did not say them.
func setBlockSizes(t *Transmission, least, pref, most uint32) {
	pow2 := func(v uint32) bool { return v != 0 && bits.OnesCount32(v) == 1 }
	if !pow2(least) || !pow2(pref) || least > pref || pref > most {
		return
	}
	t.MinBlockSize, t.BlockSize, t.MaxBlockSize = least, pref, most
}

// exportName is the old way in: no error replies, a server that does not
// serve the export just closes the connection.
func (s *session) exportName(export string, noZeroes bool) (*Transmission, error) {
	if err := s.send(optExportName, []byte(export)); err != nil {
		return nil, err
	}
	n := 10
	if !noZeroes {
		n += exportNamePad
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(s.r, b); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("NBD server %s closed the connection at export %q (it has no such export, or refuses it): %w", s.name, export, errdefs.ErrNotFound)
		}
		return nil, s.protoErr("reading the export's size", err)
	}
	t := &Transmission{}
	err := s.setExport(t, binary.BigEndian.Uint64(b), binary.BigEndian.Uint16(b[8:]), fmt.Sprintf("export %q", export))
	return t, err
}

// handOver gives t its Socket: the connection itself, or a socketpair
// with a proxy when the connection is TLS.
func (s *session) handOver(t *Transmission) error {
	if n := s.r.Buffered(); n > 0 {
		_ = s.conn.Close()
		return fmt.Errorf("NBD server %s sent %d bytes in transmission before any request: %w", s.name, n, errdefs.ErrUnavailable)
	}
	if _, isTLS := s.conn.(*tls.Conn); isTLS {
		return s.handOverProxied(t)
	}
	return s.handOverPlain(t)
}

// handOverPlain duplicates the connection's descriptor and closes the
// connection: the kernel will own the socket, not Go's poller.
func (s *session) handOverPlain(t *Transmission) error {
	defer s.conn.Close()
	sc, ok := s.conn.(syscall.Conn)
	if !ok {
		return fmt.Errorf("NBD server %s: a %T has no descriptor to hand over: %w", s.name, s.conn, errdefs.ErrUnimplemented)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return fmt.Errorf("NBD server %s: %w: %w", s.name, err, errdefs.ErrUnavailable)
	}
	fd, dupErr := -1, error(nil)
	if err := raw.Control(func(c uintptr) { fd, dupErr = unix.FcntlInt(c, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		dupErr = err
	}
	if dupErr != nil {
		return fmt.Errorf("NBD server %s: duplicating the socket: %w: %w", s.name, dupErr, errdefs.ErrUnavailable)
	}
	// The duplicate shares the connection's O_NONBLOCK; nobody polls it now.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return fmt.Errorf("NBD server %s: %w: %w", s.name, err, errdefs.ErrUnavailable)
	}
	t.Socket = os.NewFile(uintptr(fd), "nbd:"+s.name)
	return nil
}
