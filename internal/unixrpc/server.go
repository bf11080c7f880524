package unixrpc

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime/debug"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Handler serves one method. files are the descriptors the request
// carried; the server closes them when the handler returns (dup one to
// keep it).
type Handler func(ctx context.Context, body []byte, files []*os.File) (any, error)

// method is a registered handler and the logger of its calls.
type method struct {
	h   Handler
	log klog.Logger
}

// Server dispatches calls to the handlers registered with Handle.
type Server struct {
	methods  map[string]method
	instance string
	log      klog.Logger
	// AllowUID is the one user whose processes may call (checked with
	// SO_PEERCRED at accept); the socket's mode says the same, this holds
	// when the socket sits somewhere less guarded.
	allowUID uint32

	// MaxConns bounds the connections served at once (each holds a
	// goroutine, a descriptor and up to a message's buffer); past it the
	// server accepts no more until one closes, and new ones wait in the
	// listen backlog. A connection carries one call at a time, so this
	// bounds the calls in flight too. Set before Serve.
	MaxConns int
	// FrameTimeout bounds how long a connection's first request may take
	// to arrive after it is accepted, and any request to arrive once its
	// first bytes have; past it the connection is closed. An idle
	// connection between calls has no deadline: it is the client's pool.
	// Set before Serve.
	FrameTimeout time.Duration
	// AllowPeer, when set, must also accept a caller's process (its PID
	// as the server's PID namespace sees it, from SO_PEERCRED at accept):
	// who the caller is beyond its uid. Set before Serve.
	AllowPeer func(pid int) error

	deadlines deadlines
	wg        sync.WaitGroup
}

// NewServer returns a server that accepts calls from processes of the
// user it runs as and logs through logger.
func NewServer(logger klog.Logger) *Server {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return &Server{
		methods:  map[string]method{},
		instance: fmt.Sprintf("%d-%s", os.Getpid(), hex.EncodeToString(b[:])),
		log:      logger,
		allowUID: uint32(os.Geteuid()),

		MaxConns:     DefaultMaxConns,
		FrameTimeout: DefaultFrameTimeout,
	}
}

// The bounds NewServer sets. The plugin's client keeps at most maxIdle
// connections and opens more only for calls in flight at once: 64 leaves
// room for a burst, and a burst past it waits rather than fails. A
// client writes its request as soon as it connects: 10s is ample.
const (
	DefaultMaxConns     = 64
	DefaultFrameTimeout = 10 * time.Second
)

// Instance names this server process; every answer carries it, so a
// client can tell that the server restarted.
func (s *Server) Instance() string { return s.instance }

// Handle registers fn as method: the request's body decodes into Req
// (unknown fields are an InvalidArgument), the answer encodes Resp.
func Handle[Req, Resp any](s *Server, name string, fn func(ctx context.Context, req Req, files []*os.File) (Resp, error)) {
	h := func(ctx context.Context, body []byte, files []*os.File) (any, error) {
		var req Req
		if len(body) > 0 {
			if err := decodeStrict(body, &req); err != nil {
				return nil, fmt.Errorf("%s: request: %v: %w", name, err, errdefs.ErrInvalidArgument)
			}
		}
		return fn(ctx, req, files)
	}
	s.methods[name] = method{h: h, log: klog.LoggerWithValues(s.log, "method", name)}
}

func decodeStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	return d.Decode(v)
}

// Serve accepts connections on l until ctx ends, then waits for the calls
// in flight (their contexts are cancelled) and returns.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	ul, ok := l.(*net.UnixListener)
	if !ok {
		return fmt.Errorf("unixrpc: %T is not a unix listener: %w", l, errdefs.ErrInvalidArgument)
	}
	h, err := newHangups()
	if err != nil {
		return err
	}
	defer h.close()
	go func() {
		if err := h.run(); err != nil {
			s.log.Error(err, "Calls are no longer cancelled when their client goes away")
		}
	}()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Ending closes the listener and every connection: idle ones wait in a
	// read; calls in flight are cancelled with ctx.
	stop := context.AfterFunc(ctx, func() {
		ul.Close()
		h.closeConns()
	})
	defer stop()
	slots := make(chan struct{}, max(s.MaxConns, 1))
	for {
		if !s.takeSlot(ctx, slots) {
			s.wg.Wait()
			return nil
		}
		c, err := ul.AcceptUnix()
		if err != nil {
			cancel()
			s.wg.Wait()
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		cn, err := h.add(c)
		if err != nil {
			s.log.Error(err, "Refusing a connection")
			c.Close()
			<-slots
			continue
		}
		if ctx.Err() != nil {
			c.Close() // it may have come after closeConns
		}
		s.wg.Add(1)
		go func() {
			defer func() {
				<-slots
				s.wg.Done()
			}()
			s.serveConn(ctx, cn)
		}()
	}
}

// takeSlot waits until fewer than MaxConns connections are open and
// takes a slot for the next one; false: ctx ended meanwhile.
func (s *Server) takeSlot(ctx context.Context, slots chan struct{}) bool {
	select {
	case slots <- struct{}{}:
		return true
	default:
	}
	s.log.Info("At the limit of open connections; new ones wait until one closes", "limit", cap(slots))
	select {
	case slots <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (s *Server) serveConn(ctx context.Context, cn *conn) {
	c := cn.c
	defer func() {
		cn.h.remove(cn)
		c.Close()
	}()
	cred, err := peerCred(c)
	if err != nil || cred.Uid != s.allowUID {
		var uid any
		if cred != nil {
			uid = cred.Uid
		}
		s.log.Error(err, "Refusing a caller of another user", "uid", uid, "allowed", s.allowUID)
		return
	}
	if s.AllowPeer != nil {
		if err := s.AllowPeer(int(cred.Pid)); err != nil {
			s.log.Error(err, "Refusing a caller", "pid", cred.Pid)
			return
		}
	}
	r := newReader()
	r.frameTimeout = s.FrameTimeout
	// The first request must come soon: a peer that connects and sends
	// nothing would hold a slot of MaxConns for good.
	first := s.FrameTimeout > 0
	if first {
		_ = c.SetReadDeadline(time.Now().Add(s.FrameTimeout))
	}
	for ctx.Err() == nil {
		b, files, err := r.read(c)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				s.log.Info("Closing a connection whose request did not arrive in time", "timeout", s.FrameTimeout)
			}
			return // the client closed the connection, or broke the protocol
		}
		if first {
			_ = c.SetReadDeadline(time.Time{})
			first = false
		}
		resp, hungUp := s.dispatch(ctx, cn, b, files)
		closeFiles(files)
		if hungUp {
			return
		}
		out, err := json.Marshal(resp)
		if err != nil {
			// The handler's answer does not encode.
			out, err = json.Marshal(s.fail(response{Instance: s.instance}, "", fmt.Errorf("unixrpc: encoding the answer: %w", err)))
		}
		if err == nil {
			err = writeMessage(c, out, nil)
		}
		if err != nil {
			return
		}
	}
}

// dispatch runs the request's handler; hungUp says the client closed the
// connection meanwhile (and the handler's context was cancelled).
func (s *Server) dispatch(ctx context.Context, cn *conn, b []byte, files []*os.File) (resp response, hungUp bool) {
	resp.Instance = s.instance
	var req request
	if err := json.Unmarshal(b, &req); err != nil {
		return s.fail(resp, "", fmt.Errorf("unixrpc: malformed request: %v: %w", err, errdefs.ErrInvalidArgument)), false
	}
	m, ok := s.methods[req.Method]
	if !ok {
		return s.fail(resp, req.Method, fmt.Errorf("unixrpc: no method %q: %w", req.Method, errdefs.ErrUnimplemented)), false
	}
	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if req.Deadline > 0 {
		var done func()
		callCtx, done = s.deadlines.start(callCtx, time.Unix(0, req.Deadline))
		defer done()
	}
	// A call whose deadline passed before it was read (it waited for a
	// slot of MaxConns, its client gave up) is not run at all.
	if err := callCtx.Err(); err != nil {
		return s.fail(resp, req.Method, fmt.Errorf("unixrpc: %s not run, its deadline passed first: %w", req.Method, err)), false
	}
	callCtx = klog.NewContext(callCtx, m.log)
	watch := cn.watch(cancel)
	out, err := s.call(callCtx, m.h, req, files)
	if watch() {
		m.log.V(2).Info("Caller went away during the call", "err", err)
		return resp, true
	}
	if err != nil {
		return s.fail(resp, req.Method, err), false
	}
	resp.Body = out
	m.log.V(4).Info("Call succeeded")
	return resp, false
}

// call runs h, turning a panic into Internal rather than a dead server.
func (s *Server) call(ctx context.Context, h Handler, req request, files []*os.File) (out any, err error) {
	defer func() {
		if r := recover(); r != nil {
			klog.FromContext(ctx).Error(nil, "Panic in handler", "panic", r, "stack", string(debug.Stack()))
			out, err = nil, status.Errorf(codes.Internal, "internal error in %s", req.Method)
		}
	}()
	return h(ctx, req.Body, files)
}

// fail fills resp with err's code and message; errors are logged here
// once, without the request (it may hold secrets).
func (s *Server) fail(resp response, method string, err error) response {
	st, _ := status.FromError(errdefs.ToGRPC(err))
	resp.Code, resp.Message = uint32(st.Code()), st.Message()
	s.log.Error(err, "Call failed", "method", method, "code", st.Code())
	return resp
}
