// Package endpoint opens and dials the unix sockets that mountplan's
// binaries serve on (unix:///abs/path.sock).
package endpoint

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Path returns the socket path of a unix:///abs/path endpoint.
func Path(ep string) (string, error) {
	p, ok := strings.CutPrefix(ep, "unix://")
	if !ok || !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return "", fmt.Errorf("endpoint %q must be unix:///absolute/path: %w", ep, errdefs.ErrInvalidArgument)
	}
	return p, nil
}

// Listen listens on ep with a socket only its owner may use: whoever can
// connect can stage and mount. A socket a dead process left behind is
// removed; a socket something still serves on, or any other file, is not.
func Listen(ep string) (net.Listener, error) {
	p, err := Path(ep)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		return nil, err
	}
	if err := removeStale(p); err != nil {
		return nil, err
	}
	l, err := net.Listen("unix", p)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(p, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

func removeStale(p string) error {
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket: %w", p, errdefs.ErrFailedPrecondition)
	}
	// A socket that answers may still be the listener of a process just
	// killed: a child it was starting holds a copy of its descriptors
	// until that child execs. Such a listener goes within moments; a
	// server does not.
	err = wait.PollUntilContextTimeout(context.Background(), staleGrace/40, staleGrace, true, func(context.Context) (bool, error) {
		return !serving(p), nil
	})
	if err != nil { // still serving after staleGrace
		return fmt.Errorf("%s: another process is serving on it: %w", p, errdefs.ErrAlreadyExists)
	}
	return os.Remove(p)
}

// staleGrace is how long a socket may keep answering before removeStale
// takes it for a live server's.
var staleGrace = 2 * time.Second

func serving(p string) bool {
	c, err := net.DialTimeout("unix", p, time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// Dial opens a gRPC client connection to ep; it connects on the first call.
func Dial(ep string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	p, err := Path(ep)
	if err != nil {
		return nil, err
	}
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	return grpc.NewClient("unix://"+p, opts...)
}
