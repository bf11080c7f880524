package unixrpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// maxIdle bounds the connections a client keeps for later calls.
const maxIdle = 16

// Client calls a Server at a socket path. It dials lazily and keeps idle
// connections; it is safe for concurrent use.
type Client struct {
	path string

	mu        sync.Mutex
	idle      []*clientConn
	closed    bool
	instance  string
	onRestart []func()
}

// clientConn is a connection of a client and the reader of its answers.
type clientConn struct {
	*net.UnixConn
	r *reader
}

// NewClient returns a client of the server at socket path. Nothing is
// dialed until the first call.
func NewClient(path string) *Client { return &Client{path: path} }

// OnRestart registers fn, run (in a goroutine of its own) whenever an
// answer comes from another server process than the one before: the
// server restarted, and what it held in memory is gone.
func (c *Client) OnRestart(fn func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onRestart = append(c.onRestart, fn)
}

// Close closes the idle connections; calls in flight end on their own.
func (c *Client) Close() error {
	c.mu.Lock()
	idle := c.idle
	c.idle, c.closed = nil, true
	c.mu.Unlock()
	for _, conn := range idle {
		conn.Close()
	}
	return nil
}

// Call calls method with req and files, and decodes the answer into Resp.
// Errors wrap the errdefs sentinel of the server's answer; a server that
// cannot be reached is ErrUnavailable.
func Call[Req, Resp any](ctx context.Context, c *Client, method string, req Req, files ...*os.File) (Resp, error) {
	var out Resp
	err := c.call(ctx, method, req, &out, files)
	return out, err
}

// call sends in and decodes the answer into out, a pointer.
func (c *Client) call(ctx context.Context, method string, in, out any, files []*os.File) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s: %w", method, err)
	}
	req := outRequest{Method: method, Body: in}
	if d, ok := ctx.Deadline(); ok {
		req.Deadline = d.UnixNano()
	}
	msg, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if len(msg) > MaxMessage {
		return fmt.Errorf("%s: request of %d bytes exceeds %d: %w", method, len(msg), MaxMessage, errdefs.ErrResourceExhausted)
	}
	conn, err := c.send(msg, files)
	if err != nil {
		return fmt.Errorf("%s: %w", method, err)
	}
	// The context ending wakes the read; the connection is then closed,
	// which tells the server to cancel the handler.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Now()) })
	b, rfiles, err := conn.r.read(conn.UnixConn)
	closeFiles(rfiles)
	if !stop() || err != nil {
		conn.Close()
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", method, ctx.Err())
		}
		return fmt.Errorf("%s: the connection to %s broke during the call, its outcome is unknown: %v: %w", method, c.path, err, errdefs.ErrUnavailable)
	}
	// b is the reader's until the connection's next read: decoded before
	// the connection goes back to the pool.
	resp := response{Body: out}
	err = json.Unmarshal(b, &resp)
	var typeErr *json.UnmarshalTypeError
	if err != nil && !errors.As(err, &typeErr) {
		conn.Close()
		return fmt.Errorf("%s: malformed answer: %v: %w", method, err, errdefs.ErrUnavailable)
	}
	c.put(conn)
	c.sawInstance(resp.Instance)
	if resp.Code != uint32(codes.OK) {
		return errdefs.FromGRPC(status.Error(codes.Code(resp.Code), resp.Message))
	}
	if err != nil {
		return fmt.Errorf("unixrpc: %s: decoding the answer: %w", method, err)
	}
	return nil
}

// send writes msg on an idle connection, or a new one. A pooled
// connection whose server went away (it restarted) fails at once with
// EPIPE or ECONNRESET, before the server saw anything: the request is
// sent again on a fresh connection.
func (c *Client) send(msg []byte, files []*os.File) (*clientConn, error) {
	if conn := c.take(); conn != nil {
		err := writeMessage(conn.UnixConn, msg, files)
		if err == nil {
			return conn, nil
		}
		conn.Close()
		if !brokenPipe(err) {
			return nil, fmt.Errorf("%v: %w", err, errdefs.ErrUnavailable)
		}
	}
	conn, err := c.dial()
	if err != nil {
		return nil, err
	}
	if err := writeMessage(conn.UnixConn, msg, files); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrUnavailable)
	}
	return conn, nil
}

func (c *Client) dial() (*clientConn, error) {
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: c.path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("reaching %s: %v: %w", c.path, errors.Unwrap(err), errdefs.ErrUnavailable)
	}
	return &clientConn{UnixConn: conn, r: newReader()}, nil
}

func (c *Client) take() *clientConn {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.idle); n > 0 {
		conn := c.idle[n-1]
		c.idle = c.idle[:n-1]
		return conn
	}
	return nil
}

func (c *Client) put(conn *clientConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || len(c.idle) >= maxIdle {
		conn.Close()
		return
	}
	c.idle = append(c.idle, conn)
}

func (c *Client) sawInstance(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if id == "" || id == c.instance {
		return
	}
	restarted := c.instance != ""
	c.instance = id
	if !restarted {
		return
	}
	for _, fn := range c.onRestart {
		go fn()
	}
}
