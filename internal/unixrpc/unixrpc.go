// Package unixrpc makes typed calls between two processes of one node over
// a unix stream socket: a request and its answer are each one JSON
// message, and a request may carry open file descriptors (SCM_RIGHTS).
//
// It exists for the plugin's calls to the mounter. gRPC cannot pass a
// descriptor (the plugin hands the mounter a connected NBD socket), and
// each gRPC call costs about 0.24 ms of goroutine hand-offs on this kind
// of machine, where a publish cycle makes four such calls; a call here
// costs one sendmsg and one recvmsg on each side and wakes no thread
// besides the two that carry it: the server learns that a client hung up
// from an epoll set of its own (hangup.go) and ends calls at their
// client's deadline with one timer (deadline.go), neither of which does
// anything per call (BenchmarkCall counts the sleeps a call costs).
//
// The wire format is private to one build of mountplan: both ends are the
// same image. A message is a 4-byte big-endian length and that many bytes
// of JSON. A connection carries one call at a time; the client keeps idle
// connections for the next call. The client ends a call early (its context
// ended) by closing the connection, which cancels the handler's context on
// the server. Errors travel as a gRPC code and a message and come back as
// errors that wrap the matching errdefs sentinel, so errors.Is works across
// the socket as it does in process.
//
// A peer costs the server what it sends and no more: the server serves
// at most MaxConns connections at once (the rest wait to be accepted), a
// request must arrive within FrameTimeout, and a message's buffer grows
// with the bytes that arrive rather than to the length its header claims.
package unixrpc

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// MaxMessage bounds one message either way; a longer one is refused
// before it is read (ResourceExhausted), and one within it is held only
// as far as it has arrived. Requests and answers are small:
// a plan, a device, a list of namespaces.
const MaxMessage = 4 << 20

// MaxFiles bounds the descriptors one request may carry.
const MaxFiles = 8

// request is what a server reads.
type request struct {
	Method string `json:"m"`
	// Deadline is the caller's, in Unix nanoseconds; 0: none.
	Deadline int64           `json:"d,omitempty"`
	Body     json.RawMessage `json:"b,omitempty"`
}

// outRequest is what a client sends: a request with its body encoded in
// the same pass.
type outRequest struct {
	Method   string `json:"m"`
	Deadline int64  `json:"d,omitempty"`
	Body     any    `json:"b,omitempty"`
}

// response is what a server answers. Code is a gRPC code (0: OK, then
// Body is the answer). The server sets Body to the handler's result,
// encoded in the same pass; the client sets it to a pointer to the
// result's type, which the answer decodes into.
type response struct {
	Code     uint32 `json:"c,omitempty"`
	Message  string `json:"e,omitempty"`
	Body     any    `json:"b,omitempty"`
	Instance string `json:"i"`
}

// writeMessage sends b as one message on c, with files attached to its
// first bytes.
func writeMessage(c *net.UnixConn, b []byte, files []*os.File) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("unixrpc: message of %d bytes exceeds %d: %w", len(b), MaxMessage, errdefs.ErrResourceExhausted)
	}
	msg := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(msg, uint32(len(b)))
	copy(msg[4:], b)
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.WriteMsgUnix(msg, oob, nil)
	for err == nil && n < len(msg) {
		var m int
		m, err = c.Write(msg[n:])
		n += m
	}
	return err
}

// reader reads the messages of one connection. A message that fits its
// buffer takes one recvmsg: the peer sends one message and then waits
// for the answer, so a read never takes bytes of the next one.
type reader struct {
	buf []byte
	oob []byte
	// frameTimeout, when set (a server's reader), bounds how long a
	// message may take to arrive once its first bytes have: a peer that
	// starts one and stalls holds its connection no longer. A client's
	// reader leaves deadlines to the client, whose context sets them.
	frameTimeout time.Duration
}

// readBuffer fits every message but the rare large one (a plan of many
// mounts, namespaces of many consumers): those take a second recvmsg.
const readBuffer = 4 << 10

func newReader() *reader {
	return &reader{buf: make([]byte, readBuffer), oob: make([]byte, unix.CmsgSpace(MaxFiles*4))}
}

// read reads one message from c and the descriptors sent with it. The
// descriptors come back as files the caller owns, close-on-exec; the
// message is valid until the next read.
//
// A large message's buffer grows with the bytes that arrive, never to
// the size its header claims before the peer sent that much: a header
// costs the peer four bytes, and must not cost the server MaxMessage.
func (r *reader) read(c *net.UnixConn) (_ []byte, files []*os.File, err error) {
	timed := false
	defer func() {
		if timed {
			_ = c.SetReadDeadline(time.Time{})
		}
		if err != nil {
			closeFiles(files)
			files = nil
		}
	}()
	n := 0
	for n < 4 {
		if n > 0 {
			timed = r.bound(c, timed)
		}
		m, fs, err := r.recv(c, r.buf[n:], files)
		files, n = fs, n+m
		if err != nil {
			return nil, files, err
		}
	}
	size := int(binary.BigEndian.Uint32(r.buf))
	if size > MaxMessage {
		return nil, files, fmt.Errorf("unixrpc: peer sent a message of %d bytes, more than %d: %w", size, MaxMessage, errdefs.ErrResourceExhausted)
	}
	end := 4 + size
	if n > end {
		return nil, files, fmt.Errorf("unixrpc: peer sent %d bytes past a message of %d: %w", n-end, size, errdefs.ErrInvalidArgument)
	}
	var msg []byte
	if end <= len(r.buf) {
		msg = r.buf[4:n:end]
	} else {
		msg = make([]byte, n-4, min(size, 2*readBuffer))
		copy(msg, r.buf[4:n])
	}
	for len(msg) < size {
		timed = r.bound(c, timed)
		if len(msg) == cap(msg) {
			// Doubling: what is held stays within twice what arrived.
			msg = slices.Grow(msg, min(size-len(msg), cap(msg)))
		}
		m, fs, err := r.recv(c, msg[len(msg):min(cap(msg), size)], files)
		files, msg = fs, msg[:len(msg)+m]
		if err != nil {
			return nil, files, err
		}
	}
	return msg, files, nil
}

// bound sets the deadline of a message whose first bytes came (once per
// message: timed says it is set already) when the reader has a frame
// timeout. A message takes one recvmsg almost always, so this costs the
// common call nothing.
func (r *reader) bound(c *net.UnixConn, timed bool) bool {
	if timed || r.frameTimeout <= 0 {
		return timed
	}
	_ = c.SetReadDeadline(time.Now().Add(r.frameTimeout))
	return true
}

// recv reads some bytes into b, collecting the descriptors that arrive
// with them.
func (r *reader) recv(c *net.UnixConn, b []byte, files []*os.File) (int, []*os.File, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(b, r.oob)
	if oobn > 0 {
		fs, perr := parseRights(r.oob[:oobn])
		files = append(files, fs...)
		if perr != nil {
			return n, files, perr
		}
	}
	if flags&unix.MSG_CTRUNC != 0 || len(files) > MaxFiles {
		return n, files, fmt.Errorf("unixrpc: peer sent more than %d descriptors: %w", MaxFiles, errdefs.ErrResourceExhausted)
	}
	if err != nil {
		return n, files, err
	}
	if n == 0 {
		return n, files, io.ErrUnexpectedEOF
	}
	return n, files, nil
}

func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var files []*os.File
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			// The kernel sets close-on-exec only if asked (MSG_CMSG_CLOEXEC,
			// which the net package does not pass): set it before anything
			// else can fork.
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "unixrpc-fd"))
		}
	}
	return files, nil
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// peerCred is the peer's credentials (SO_PEERCRED): for an accepted
// connection its process at connect(2), for a dialed one the process that
// called listen(2); the PID as the caller's PID namespace sees it.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, os.NewSyscallError("getsockopt(SO_PEERCRED)", cerr)
	}
	return cred, nil
}

// ListenerPID returns the PID of the process that listens on the unix
// socket at path, from a connection to it that sends nothing and is closed
// at once: who serves a socket, as the kernel says, not as anyone claims.
func ListenerPID(path string) (int, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return 0, err
	}
	defer c.Close()
	cred, err := peerCred(c)
	if err != nil {
		return 0, err
	}
	return int(cred.Pid), nil
}

// brokenPipe reports whether a write failed because the peer is gone: a
// pooled connection whose server restarted.
func brokenPipe(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}
