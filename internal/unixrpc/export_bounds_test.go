package unixrpc

import "time"

// SetBounds sets s's bounds for a test: the connections served at once
// and the time a request may take to arrive.
func SetBounds(s *Server, conns int, frame time.Duration) {
	s.MaxConns, s.FrameTimeout = conns, frame
}
