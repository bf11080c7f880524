package unixrpc

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
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
	}
}

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
	for {
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
			continue
		}
		if ctx.Err() != nil {
			c.Close() // it may have come after closeConns
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(ctx, cn)
		}()
	}
}

func (s *Server) serveConn(ctx context.Context, cn *conn) {
	c := cn.c
	defer func() {
		cn.h.remove(cn)
		c.Close()
	}()
	if uid, err := peerUID(c); err != nil || uid != s.allowUID {
		s.log.Error(err, "Refusing a caller of another user", "uid", uid, "allowed", s.allowUID)
		return
	}
	r := newReader()
	for ctx.Err() == nil {
		b, files, err := r.read(c)
		if err != nil {
			return // the client closed the connection, or broke the protocol
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
