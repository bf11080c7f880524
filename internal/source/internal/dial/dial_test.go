package dial

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestConnSetsTheDeadline(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	conn, deadline, err := Conn(t.Context(), "tcp", l.Addr().String(), 200*time.Millisecond, "test server")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if until := time.Until(deadline); until <= 0 || until > 200*time.Millisecond {
		t.Fatalf("deadline in %v", until)
	}
	// Nobody writes: the read ends at the deadline, not never.
	_, err = conn.Read(make([]byte, 1))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past the deadline: %v", err)
	}
}

func TestConnUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	_, _, err = Conn(t.Context(), "tcp", addr, time.Second, "NBD server "+addr)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.HasPrefix(err.Error(), "NBD server "+addr+" is unreachable") {
		t.Fatalf("dial of a closed port: %v", err)
	}
}
