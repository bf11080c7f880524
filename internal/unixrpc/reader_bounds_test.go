package unixrpc

import (
	"encoding/binary"
	"net"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// socketPair returns both ends of a connected unix stream socket.
func socketPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}

// TestReadAllocatesWhatArrives: a header that claims MaxMessage followed
// by a few bytes costs the reader about what arrived, not MaxMessage.
func TestReadAllocatesWhatArrives(t *testing.T) {
	server, peer := socketPair(t)
	sent := append(binary.BigEndian.AppendUint32(nil, MaxMessage), make([]byte, 8<<10)...)
	if _, err := peer.Write(sent); err != nil {
		t.Fatal(err)
	}
	peer.Close()
	r := newReader()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, err := r.read(server)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("a message cut short was read whole")
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Errorf("reading %d bytes of a message claiming %d allocated %d bytes; want well under 1 MiB", len(sent), MaxMessage, got)
	}
}
