// Package endpoint opens and dials the unix sockets that mountplan's
// binaries serve on (unix:///abs/path.sock).
package endpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

// Path returns the socket path of a unix:// endpoint.
func Path(ep string) (string, error) {
	p, ok := strings.CutPrefix(ep, "unix://")
	if !ok || !filepath.IsAbs(p) {
		return "", fmt.Errorf("endpoint %q must be unix:///absolute/path: %w", ep, errdefs.ErrInvalidArgument)
	}
	return filepath.Clean(p), nil
}

// Listen listens on ep, first removing a stale socket a dead process left
// behind. Anything at that path that is not a socket is left alone.
func Listen(ep string) (net.Listener, error) {
	p, err := Path(ep)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		return nil, err
	}
	fi, err := os.Lstat(p)
	switch {
	case err == nil && fi.Mode().Type() == fs.ModeSocket:
		if err := os.Remove(p); err != nil {
			return nil, fmt.Errorf("remove stale socket %s: %w", p, err)
		}
	case err == nil:
		return nil, fmt.Errorf("%s exists and is not a socket: %w", p, errdefs.ErrFailedPrecondition)
	case !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	return net.Listen("unix", p)
}

// Dial opens a gRPC client connection to ep.
func Dial(ep string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	p, err := Path(ep)
	if err != nil {
		return nil, err
	}
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	return grpc.NewClient("unix://"+p, opts...)
}
