// Package dial opens the TCP and unix connections the network sources
// speak their protocols over (the NBD handshake, iSCSI discovery).
package dial

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// DefaultTimeout bounds a whole exchange when the caller names none.
const DefaultTimeout = 10 * time.Second

// Conn connects to address within timeout (DefaultTimeout when zero) and
// sets the connection's deadline to the same instant, so the whole
// exchange that follows is bounded too; it returns that deadline for a
// caller that wraps the connection (TLS). A failure is ErrUnavailable and
// names the peer as what ("NBD server 10.0.0.1:10809").
func Conn(ctx context.Context, network, address string, timeout time.Duration, what string) (net.Conn, time.Time, error) {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	var nd net.Dialer
	conn, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("%s is unreachable: %w: %w", what, err, errdefs.ErrUnavailable)
	}
	if err := conn.SetDeadline(deadline); err != nil {
		conn.Close()
		return nil, time.Time{}, fmt.Errorf("%s: %w: %w", what, err, errdefs.ErrUnavailable)
	}
	return conn, deadline, nil
}
