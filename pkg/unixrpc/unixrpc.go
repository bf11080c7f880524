// Package unixrpc makes typed calls between two processes of one node over
// a unix stream socket: a request and its answer are each one JSON
// message, and a request may carry open file descriptors (SCM_RIGHTS).
//
// It exists for the plugin's calls to the mounter. gRPC cannot pass a
// descriptor (the plugin hands the mounter a connected NBD socket), and
// each gRPC call costs about 0.24 ms of goroutine hand-offs on this kind
// of machine, where a publish cycle makes four such calls; a call here
// costs one write and one read on each side.
//
// The wire format is private to one build of mountplan: both ends are the
// same image. A message is a 4-byte big-endian length and that many bytes
// of JSON. A connection carries one call at a time; the client keeps idle
// connections for the next call. The client ends a call early (its context
// ended) by closing the connection, which cancels the handler's context on
// the server. Errors travel as a gRPC code and a message and come back as
// errors that wrap the matching errdefs sentinel, so errors.Is works across
// the socket as it does in process.
package unixrpc

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

// MaxMessage bounds one message either way; a longer one is refused
// before it is read (ResourceExhausted). Requests and answers are small:
// a plan, a device, a list of namespaces.
const MaxMessage = 4 << 20

// MaxFiles bounds the descriptors one request may carry.
const MaxFiles = 8

// request is what a client sends.
type request struct {
	Method string `json:"m"`
	// Deadline is the caller's, in Unix nanoseconds; 0: none.
	Deadline int64           `json:"d,omitempty"`
	Body     json.RawMessage `json:"b,omitempty"`
}

// response is what a server answers. Code is a gRPC code (0: OK, then
// Body is the answer).
type response struct {
	Code     uint32          `json:"c,omitempty"`
	Message  string          `json:"e,omitempty"`
	Body     json.RawMessage `json:"b,omitempty"`
	Instance string          `json:"i"`
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

// readMessage reads one message from c and the descriptors sent with it.
// The descriptors come back as files the caller owns, close-on-exec.
func readMessage(c *net.UnixConn) (_ []byte, files []*os.File, err error) {
	defer func() {
		if err != nil {
			closeFiles(files)
			files = nil
		}
	}()
	var head [4]byte
	if files, err = readFull(c, head[:], files); err != nil {
		return nil, files, err
	}
	n := binary.BigEndian.Uint32(head[:])
	if n > MaxMessage {
		return nil, files, fmt.Errorf("unixrpc: peer sent a message of %d bytes, more than %d: %w", n, MaxMessage, errdefs.ErrResourceExhausted)
	}
	b := make([]byte, n)
	files, err = readFull(c, b, files)
	return b, files, err
}

// readFull fills b, collecting the descriptors that arrive on the way.
func readFull(c *net.UnixConn, b []byte, files []*os.File) ([]*os.File, error) {
	oob := make([]byte, unix.CmsgSpace(MaxFiles*4))
	for off := 0; off < len(b); {
		n, oobn, flags, _, err := c.ReadMsgUnix(b[off:], oob)
		if oobn > 0 {
			fs, perr := parseRights(oob[:oobn])
			files = append(files, fs...)
			if perr != nil {
				return files, perr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 {
			return files, fmt.Errorf("unixrpc: peer sent more than %d descriptors: %w", MaxFiles, errdefs.ErrResourceExhausted)
		}
		if len(files) > MaxFiles {
			return files, fmt.Errorf("unixrpc: peer sent more than %d descriptors: %w", MaxFiles, errdefs.ErrResourceExhausted)
		}
		if err != nil {
			return files, err
		}
		if n == 0 {
			return files, io.ErrUnexpectedEOF
		}
		off += n
	}
	return files, nil
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

// peerUID returns the user ID of the process at the other end of c.
func peerUID(c *net.UnixConn) (uint32, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, os.NewSyscallError("getsockopt(SO_PEERCRED)", cerr)
	}
	return cred.Uid, nil
}

// brokenPipe reports whether a write failed because the peer is gone: a
// pooled connection whose server restarted.
func brokenPipe(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}
