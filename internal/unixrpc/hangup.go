package unixrpc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// hangups tells a server which clients hung up during their call, at no
// cost to a call: every connection is put at accept in an epoll set of
// the server's own that reports nothing but the peer's hangup
// (EPOLLRDHUP), and that set's descriptor waits in Go's netpoller, read
// by one goroutine that runs only when a client went away. A goroutine
// parked in a read of each call's connection would do as well, but
// starting it wakes a thread, and on a node with two CPUs the woken
// thread takes the CPU from the handler (BenchmarkCall).
type hangups struct {
	set *os.File // the epoll set
	raw syscall.RawConn

	mu     sync.Mutex
	conns  map[uint64]*conn
	next   uint64
	closed bool
}

func newHangups() (*hangups, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	// Non-blocking, so that os.NewFile puts it in the netpoller.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("fcntl", err)
	}
	set := os.NewFile(uintptr(fd), "unixrpc-hangups")
	raw, err := set.SyscallConn()
	if err != nil {
		set.Close()
		return nil, err
	}
	return &hangups{set: set, raw: raw, conns: map[uint64]*conn{}}, nil
}

// run cancels the call of each connection whose client hangs up, until
// close; an error means hangups are no longer seen.
func (h *hangups) run() error {
	events := make([]unix.EpollEvent, 16)
	err := h.raw.Read(func(fd uintptr) bool {
		for {
			n, err := unix.EpollWait(int(fd), events, 0)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if n <= 0 {
				return false // nothing more: wait until the set is ready again
			}
			for _, ev := range events[:n] {
				h.hungUp(uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32)
			}
		}
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	return fmt.Errorf("unixrpc: watching for clients that hang up: %w", err)
}

func (h *hangups) close() error {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	return h.set.Close()
}

// closeConns closes every connection: idle ones wait in a read.
func (h *hangups) closeConns() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, cn := range h.conns {
		cn.c.Close()
	}
}

func (h *hangups) hungUp(id uint64) {
	h.mu.Lock()
	cn := h.conns[id]
	h.mu.Unlock()
	if cn != nil {
		cn.hangUp()
	}
}

// add watches c for its client's hangup: once, then the connection is
// done with (EPOLLONESHOT).
func (h *hangups) add(c *net.UnixConn) (*conn, error) {
	h.mu.Lock()
	h.next++
	cn := &conn{c: c, id: h.next, h: h}
	h.conns[cn.id] = cn
	h.mu.Unlock()
	ev := unix.EpollEvent{Events: unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: int32(uint32(cn.id)), Pad: int32(uint32(cn.id >> 32))}
	if err := h.ctl(c, unix.EPOLL_CTL_ADD, &ev); err != nil {
		h.forget(cn)
		return nil, err
	}
	return cn, nil
}

// remove stops watching cn's connection, before it is closed.
func (h *hangups) remove(cn *conn) {
	_ = h.ctl(cn.c, unix.EPOLL_CTL_DEL, nil)
	h.forget(cn)
}

func (h *hangups) forget(cn *conn) {
	h.mu.Lock()
	delete(h.conns, cn.id)
	h.mu.Unlock()
}

// ctl runs epoll_ctl(op) for c's descriptor in the set, both kept open
// meanwhile.
func (h *hangups) ctl(c *net.UnixConn, op int, ev *unix.EpollEvent) error {
	craw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	err = craw.Control(func(cfd uintptr) {
		err := h.raw.Control(func(set uintptr) {
			cerr = os.NewSyscallError("epoll_ctl", unix.EpollCtl(int(set), op, int(cfd), ev))
		})
		if err != nil {
			cerr = err
		}
	})
	if err != nil {
		return err
	}
	return cerr
}

// conn is a server's connection and the call it runs.
type conn struct {
	c  *net.UnixConn
	id uint64
	h  *hangups

	mu     sync.Mutex
	gone   bool               // the client hung up
	cancel context.CancelFunc // the call in flight's; nil between calls
}

// hangUp records that the client went away and cancels its call.
func (cn *conn) hangUp() {
	cn.mu.Lock()
	cn.gone = true
	cancel := cn.cancel
	cn.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// watch has the client's hangup cancel the call from now on; stop ends
// that and reports whether the client hung up (before the call too).
func (cn *conn) watch(cancel context.CancelFunc) (stop func() (hungUp bool)) {
	cn.mu.Lock()
	cn.cancel = cancel
	gone := cn.gone
	cn.mu.Unlock()
	if gone {
		cancel()
	}
	return func() bool {
		cn.mu.Lock()
		defer cn.mu.Unlock()
		cn.cancel = nil
		return cn.gone
	}
}
