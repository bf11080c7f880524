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
	"net"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/dial"
)

// The fixed-newstyle handshake of the NBD protocol (doc/proto.md of the
// nbd project), as far as a probe needs it: options, never transmission.
const (
	magicInit      = 0x4e42444d41474943 // "NBDMAGIC"
	magicOpt       = 0x49484156454f5054 // "IHAVEOPT"
	magicReply     = 0x0003e889045565a9
	flagFixedNew   = 1 << 0 // server handshake flag / client flag
	flagNoZeroes   = 1 << 1
	optAbort       = 2
	optList        = 3
	optStartTLS    = 5
	optInfo        = 6
	repAck         = 1
	repServer      = 2
	repInfo        = 3
	repErr         = 1 << 31
	repErrUnsup    = repErr | 1
	repErrPolicy   = repErr | 2
	repErrTLSReqd  = repErr | 5
	repErrUnknown  = repErr | 6
	infoExport     = 0
	txFlagReadOnly = 1 << 1
	maxReplyLength = 1 << 20
)

// Export is what a server says about an export.
type Export struct {
	Size     int64
	ReadOnly bool
	// Known is false when the server does not answer NBD_OPT_INFO (an old
	// server): the export's existence is then learnt only at connect.
	Known bool
}

// Dialer reaches one NBD server.
type Dialer struct {
	// Network is "tcp" or "unix"; Address is HOST:PORT or a socket path.
	Network, Address string
	// TLS, when not nil, upgrades the connection with NBD_OPT_STARTTLS.
	TLS *tls.Config
	// Timeout bounds the whole exchange (default 10s).
	Timeout time.Duration
}

func (d Dialer) String() string {
	if d.Network == "unix" {
		return "unix:" + d.Address
	}
	return d.Address
}

// session is one option-haggling connection.
type session struct {
	conn net.Conn
	r    *bufio.Reader
	name string
}

func (d Dialer) open(ctx context.Context) (*session, error) {
	conn, deadline, err := dial.Conn(ctx, d.Network, d.Address, d.Timeout, "NBD server "+d.String())
	if err != nil {
		return nil, err
	}
	s := &session{conn: conn, r: bufio.NewReader(conn), name: d.String()}
	if err := s.greet(); err != nil {
		conn.Close()
		return nil, err
	}
	if d.TLS != nil {
		if err := s.startTLS(d.TLS); err != nil {
			conn.Close()
			return nil, err
		}
		_ = s.conn.SetDeadline(deadline)
	}
	return s, nil
}

func (s *session) protoErr(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err = fmt.Errorf("connection closed: %w", err)
	}
	return fmt.Errorf("NBD server %s: %s: %w: %w", s.name, what, err, errdefs.ErrUnavailable)
}

// greet reads the server's greeting and sends the client flags.
func (s *session) greet() error {
	var hello struct {
		Init, Opt uint64
		Flags     uint16
	}
	if err := binary.Read(s.r, binary.BigEndian, &hello); err != nil {
		return s.protoErr("reading the greeting", err)
	}
	if hello.Init != magicInit || hello.Opt != magicOpt {
		return fmt.Errorf("%s does not speak the NBD newstyle protocol: %w", s.name, errdefs.ErrFailedPrecondition)
	}
	if hello.Flags&flagFixedNew == 0 {
		return fmt.Errorf("NBD server %s does not offer fixed newstyle negotiation: %w", s.name, errdefs.ErrFailedPrecondition)
	}
	client := uint32(flagFixedNew)
	if hello.Flags&flagNoZeroes != 0 {
		client |= flagNoZeroes
	}
	if err := binary.Write(s.conn, binary.BigEndian, client); err != nil {
		return s.protoErr("sending client flags", err)
	}
	return nil
}

func (s *session) send(opt uint32, data []byte) error {
	hdr := make([]byte, 16, 16+len(data))
	binary.BigEndian.PutUint64(hdr, magicOpt)
	binary.BigEndian.PutUint32(hdr[8:], opt)
	binary.BigEndian.PutUint32(hdr[12:], uint32(len(data)))
	if _, err := s.conn.Write(append(hdr, data...)); err != nil {
		return s.protoErr(fmt.Sprintf("sending option %d", opt), err)
	}
	return nil
}

type reply struct {
	typ  uint32
	data []byte
}

func (s *session) recv(opt uint32) (reply, error) {
	var h struct {
		Magic     uint64
		Opt, Type uint32
		Length    uint32
	}
	if err := binary.Read(s.r, binary.BigEndian, &h); err != nil {
		return reply{}, s.protoErr(fmt.Sprintf("reading the reply to option %d", opt), err)
	}
	if h.Magic != magicReply || h.Opt != opt || h.Length > maxReplyLength {
		return reply{}, fmt.Errorf("NBD server %s sent a malformed reply to option %d: %w", s.name, opt, errdefs.ErrUnavailable)
	}
	r := reply{typ: h.Type, data: make([]byte, h.Length)}
	if _, err := io.ReadFull(s.r, r.data); err != nil {
		return reply{}, s.protoErr("reading reply data", err)
	}
	return r, nil
}

// replyError turns an error reply into an error wrapping the right sentinel.
func (s *session) replyError(r reply, what string) error {
	msg := ""
	if len(r.data) > 0 {
		msg = ": server says " + sanitize(r.data)
	}
	switch r.typ {
	case repErrUnknown:
		return fmt.Errorf("%s on NBD server %s: not found%s: %w", what, s.name, msg, errdefs.ErrNotFound)
	case repErrTLSReqd:
		return fmt.Errorf("NBD server %s requires TLS for %s; set the volume's tls attribute (the admin config must provide nbd.tls)%s: %w", s.name, what, msg, errdefs.ErrFailedPrecondition)
	case repErrPolicy:
		return fmt.Errorf("NBD server %s refuses %s by its policy%s: %w", s.name, what, msg, errdefs.ErrPermissionDenied)
	case repErrUnsup:
		return fmt.Errorf("NBD server %s does not support %s%s: %w", s.name, what, msg, errdefs.ErrUnimplemented)
	}
	return fmt.Errorf("NBD server %s rejected %s with error %#x%s: %w", s.name, what, r.typ, msg, errdefs.ErrFailedPrecondition)
}

// sanitize keeps a server's message printable and short.
func sanitize(b []byte) string {
	if len(b) > 200 {
		b = b[:200]
	}
	out := make([]rune, 0, len(b))
	for _, c := range string(b) {
		if c < 0x20 || c == 0x7f {
			c = '?'
		}
		out = append(out, c)
	}
	return fmt.Sprintf("%q", string(out))
}

func (s *session) startTLS(cfg *tls.Config) error {
	if err := s.send(optStartTLS, nil); err != nil {
		return err
	}
	r, err := s.recv(optStartTLS)
	if err != nil {
		return err
	}
	if r.typ != repAck {
		return s.replyError(r, "TLS")
	}
	tc := tls.Client(s.conn, cfg)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("NBD server %s: TLS handshake: %w: %w", s.name, err, errdefs.ErrFailedPrecondition)
	}
	s.conn, s.r = tc, bufio.NewReader(tc)
	return nil
}

// close ends the negotiation politely; errors do not matter any more.
func (s *session) close() {
	if s.send(optAbort, nil) == nil {
		_, _ = s.recv(optAbort)
	}
	_ = s.conn.Close()
}

// Probe asks the server about export with NBD_OPT_INFO, without entering
// transmission: an unknown export is ErrNotFound, a server that wants TLS
// or refuses by policy says so, an unreachable one is ErrUnavailable.
func (d Dialer) Probe(ctx context.Context, export string) (Export, error) {
	s, err := d.open(ctx)
	if err != nil {
		return Export{}, err
	}
	defer s.close()
	data := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	data = append(data, export...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, infoExport)
	if err := s.send(optInfo, data); err != nil {
		return Export{}, err
	}
	var e Export
	what := fmt.Sprintf("export %q", export)
	for {
		r, err := s.recv(optInfo)
		if err != nil {
			return Export{}, err
		}
		switch {
		case r.typ == repAck:
			return e, nil
		case r.typ == repInfo:
			if len(r.data) >= 12 && binary.BigEndian.Uint16(r.data) == infoExport {
				size := binary.BigEndian.Uint64(r.data[2:])
				if size > math.MaxInt64 {
					return Export{}, fmt.Errorf("NBD server %s reports a size of %d bytes for %s: %w", s.name, size, what, errdefs.ErrUnavailable)
				}
				e.Size = int64(size)
				e.ReadOnly = binary.BigEndian.Uint16(r.data[10:])&txFlagReadOnly != 0
				e.Known = true
			}
		case r.typ == repErrUnsup:
			return Export{}, nil // an old server: connect will tell
		case r.typ&repErr != 0:
			return Export{}, s.replyError(r, what)
		}
	}
}

// List returns the export names the server lists (NBD_OPT_LIST).
func (d Dialer) List(ctx context.Context) ([]string, error) {
	s, err := d.open(ctx)
	if err != nil {
		return nil, err
	}
	defer s.close()
	if err := s.send(optList, nil); err != nil {
		return nil, err
	}
	var names []string
	for {
		r, err := s.recv(optList)
		if err != nil {
			return nil, err
		}
		switch {
		case r.typ == repAck:
			return names, nil
		case r.typ == repServer:
			if len(r.data) < 4 || int(binary.BigEndian.Uint32(r.data)) > len(r.data)-4 {
				return nil, fmt.Errorf("NBD server %s sent a malformed export list: %w", s.name, errdefs.ErrUnavailable)
			}
			names = append(names, string(r.data[4:4+binary.BigEndian.Uint32(r.data)]))
		case r.typ&repErr != 0:
			return nil, s.replyError(r, "listing exports")
		}
	}
}
