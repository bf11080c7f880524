// Package bytesrvtest is the server of the fuzz tests of the plugin's network
// clients (the NBD handshake, iSCSI discovery): whatever a client sends, it
// answers with the bytes of the fuzzer's current input, then
// end-of-stream, and reads until the client hangs up.
package bytesrvtest

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// Server answers every connection on its listener with the current bytes.
type Server struct {
	current atomic.Pointer[[]byte]
}

// Serve answers the connections l accepts until the test ends (it closes
// l then). Set the bytes with Set before a client connects.
func Serve(tb testing.TB, l net.Listener) *Server {
	s := &Server{}
	empty := []byte{}
	s.current.Store(&empty)
	tb.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serve(c, *s.current.Load())
		}
	}()
	return s
}

// Set makes data the answer to the connections from now on.
func (s *Server) Set(data []byte) { s.current.Store(&data) }

// serve sends data, reads whatever the client sends until it hangs up, and
// says end-of-stream after data (a half-close where the connection has one).
func serve(c net.Conn, data []byte) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	drained := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, c)
		close(drained)
	}()
	_, _ = c.Write(data)
	if hc, ok := c.(interface{ CloseWrite() error }); ok {
		_ = hc.CloseWrite()
	}
	<-drained
}
