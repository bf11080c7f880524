package unixrpc_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/unixrpc"
)

type echoReq struct {
	Text string `json:"text"`
}

type echoResp struct {
	Text  string `json:"text"`
	Files int    `json:"files"`
}

// serve starts s on a socket in a temp dir until the test ends and
// returns the socket's path.
func serve(t *testing.T, s *unixrpc.Server) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "rpc.sock")
	return serveAt(t, s, path)
}

func serveAt(t *testing.T, s *unixrpc.Server, path string) string {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return path
}

func newServer(t *testing.T) (*unixrpc.Server, *atomic.Bool) {
	s := unixrpc.NewServer(klog.Background())
	cancelled := &atomic.Bool{}
	unixrpc.Handle(s, "Echo", func(_ context.Context, r echoReq, files []*os.File) (echoResp, error) {
		for _, f := range files {
			if _, err := f.WriteString("from server"); err != nil {
				return echoResp{}, err
			}
		}
		return echoResp{Text: r.Text, Files: len(files)}, nil
	})
	unixrpc.Handle(s, "Fail", func(_ context.Context, r echoReq, _ []*os.File) (echoResp, error) {
		return echoResp{}, errors.Join(errors.New("no such thing: "+r.Text), errdefs.ErrNotFound)
	})
	unixrpc.Handle(s, "Panic", func(context.Context, echoReq, []*os.File) (echoResp, error) {
		panic("boom")
	})
	unixrpc.Handle(s, "Block", func(ctx context.Context, _ echoReq, _ []*os.File) (echoResp, error) {
		<-ctx.Done()
		cancelled.Store(true)
		return echoResp{}, ctx.Err()
	})
	unixrpc.Handle(s, "BlockDerived", func(ctx context.Context, _ echoReq, _ []*os.File) (echoResp, error) {
		ctx, cancel := context.WithTimeout(ctx, time.Hour)
		defer cancel()
		<-ctx.Done()
		return echoResp{}, context.Cause(ctx)
	})
	unixrpc.Handle(s, "Deadline", func(ctx context.Context, _ echoReq, _ []*os.File) (echoResp, error) {
		d, ok := ctx.Deadline()
		if !ok {
			return echoResp{}, errors.New("no deadline")
		}
		return echoResp{Text: time.Until(d).Round(time.Minute).String()}, nil
	})
	return s, cancelled
}

func TestCall(t *testing.T) {
	s, _ := newServer(t)
	c := unixrpc.NewClient(serve(t, s))
	defer c.Close()
	ctx := context.Background()
	for i := range 3 { // the second and third reuse the pooled connection
		got, err := unixrpc.Call[echoReq, echoResp](ctx, c, "Echo", echoReq{Text: "hello"})
		if err != nil || got.Text != "hello" {
			t.Fatalf("call %d: %+v, %v", i, got, err)
		}
	}
	cases := []struct {
		method string
		want   error
	}{
		{"Fail", errdefs.ErrNotFound},
		{"Panic", nil}, // Internal: no sentinel
		{"Nope", errdefs.ErrUnimplemented},
	}
	for _, tc := range cases {
		_, err := unixrpc.Call[echoReq, echoResp](ctx, c, tc.method, echoReq{Text: "x"})
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%s: %v, want %v", tc.method, err, tc.want)
		}
		if tc.method == "Fail" && !strings.Contains(err.Error(), "no such thing: x") {
			t.Errorf("Fail lost its message: %v", err)
		}
	}
	// A request with a field the handler does not know is refused.
	_, err := unixrpc.Call[map[string]string, echoResp](ctx, c, "Echo", map[string]string{"extra": "1"})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("unknown field: %v, want InvalidArgument", err)
	}
	d, err := unixrpc.Call[echoReq, echoResp](withTimeout(t, time.Hour), c, "Deadline", echoReq{})
	if err != nil || d.Text != "1h0m0s" {
		t.Errorf("deadline did not travel: %+v, %v", d, err)
	}
}

func withTimeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestFiles passes a pipe's write end to the server, which writes to it.
func TestFiles(t *testing.T) {
	s, _ := newServer(t)
	c := unixrpc.NewClient(serve(t, s))
	defer c.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: "fd"}, w)
	w.Close()
	if err != nil || got.Files != 1 {
		t.Fatalf("%+v, %v", got, err)
	}
	b := make([]byte, 64)
	n, _ := r.Read(b)
	if string(b[:n]) != "from server" {
		t.Fatalf("read %q through the passed pipe", b[:n])
	}
	// The server closed its copy: with ours closed too, the pipe ends.
	if n, err := r.Read(b); n != 0 || err == nil {
		t.Fatalf("the server kept the descriptor: read %d, %v", n, err)
	}
}

// TestCancel: a client whose context ends closes the connection, and the
// handler's context is cancelled.
func TestCancel(t *testing.T) {
	s, cancelled := newServer(t)
	c := unixrpc.NewClient(serve(t, s))
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := unixrpc.Call[echoReq, echoResp](ctx, c, "Block", echoReq{})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Block: %v, want DeadlineExceeded", err)
	}
	waitFor(t, "the handler's context to be cancelled", cancelled.Load)
	if _, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: "after"}); err != nil {
		t.Fatalf("call after a cancelled one: %v", err)
	}
}

// TestServerRestart: pooled connections of a dead server are dropped,
// the request goes to the new one, and OnRestart fires.
func TestServerRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rpc.sock")
	s1, _ := newServer(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ctx1, stop1 := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s1.Serve(ctx1, l) }()
	c := unixrpc.NewClient(path)
	defer c.Close()
	restarted := make(chan struct{}, 1)
	c.OnRestart(func() { restarted <- struct{}{} })
	if _, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: "1"}); err != nil {
		t.Fatal(err)
	}
	stop1()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	_ = os.Remove(path)
	if _, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: "2"}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("no server: %v, want Unavailable", err)
	}
	s2, _ := newServer(t)
	serveAt(t, s2, path)
	if got, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: "3"}); err != nil || got.Text != "3" {
		t.Fatalf("after the restart: %+v, %v", got, err)
	}
	select {
	case <-restarted:
	case <-time.After(5 * time.Second):
		t.Fatal("OnRestart did not fire")
	}
}

// TestTooLarge: a message over MaxMessage is refused before it is sent.
func TestTooLarge(t *testing.T) {
	s, _ := newServer(t)
	c := unixrpc.NewClient(serve(t, s))
	defer c.Close()
	_, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: strings.Repeat("x", unixrpc.MaxMessage)})
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("oversized request: %v, want ResourceExhausted", err)
	}
}

// TestHangup: a client that closes its connection during a call, without
// a context of this package's client behind it, has the handler's
// context cancelled, at once or after it sent the request.
func TestHangup(t *testing.T) {
	for _, pause := range []time.Duration{0, 50 * time.Millisecond} {
		t.Run(pause.String(), func(t *testing.T) {
			s, cancelled := newServer(t)
			path := serve(t, s)
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			body := []byte(`{"m":"Block","b":{}}`)
			msg := append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			time.Sleep(pause)
			c.Close()
			waitFor(t, "the handler's context to be cancelled", cancelled.Load)
		})
	}
}

// TestShutdown: a server whose context ends cancels the call in flight
// and returns; its client learns that the call did not complete.
func TestShutdown(t *testing.T) {
	s, cancelled := newServer(t)
	path := filepath.Join(t.TempDir(), "rpc.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	c := unixrpc.NewClient(path)
	defer c.Close()
	called := make(chan error, 1)
	go func() {
		_, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Block", echoReq{})
		called <- err
	}()
	time.Sleep(50 * time.Millisecond)
	stop()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if !cancelled.Load() {
		t.Error("Serve returned before the call in flight was cancelled")
	}
	// The handler may answer before its connection is closed.
	if err := <-called; !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, context.Canceled) {
		t.Errorf("the call in flight: %v, want Unavailable or Canceled", err)
	}
}

// TestLarge: messages larger than a read's buffer, up to the bound, make
// the round trip whole.
func TestLarge(t *testing.T) {
	s, _ := newServer(t)
	c := unixrpc.NewClient(serve(t, s))
	defer c.Close()
	for _, n := range []int{4<<10 - 40, 4 << 10, 64 << 10, unixrpc.MaxMessage - 64} {
		text := strings.Repeat("x", n)
		got, err := unixrpc.Call[echoReq, echoResp](context.Background(), c, "Echo", echoReq{Text: text})
		if err != nil || got.Text != text {
			t.Fatalf("%d bytes: %d bytes back, %v", n, len(got.Text), err)
		}
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited 5s for %s", what)
		}
	}
}

// TestDeadline: the server ends a call at its client's deadline, whether
// or not the client hangs up then: the handler's context ends with
// DeadlineExceeded, as does (as its cause) a context derived from it; a
// deadline already past ends the call at once.
func TestDeadline(t *testing.T) {
	s, _ := newServer(t)
	path := serve(t, s)
	cases := []struct {
		method string
		in     time.Duration
	}{
		{"Block", 50 * time.Millisecond},
		{"BlockDerived", 50 * time.Millisecond},
		{"Block", -time.Second},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%s/%v", tc.method, tc.in), func(t *testing.T) {
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			body := fmt.Appendf(nil, `{"m":%q,"d":%d,"b":{}}`, tc.method, time.Now().Add(tc.in).UnixNano())
			if _, err := c.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)); err != nil {
				t.Fatal(err)
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			var head [4]byte
			if _, err := io.ReadFull(c, head[:]); err != nil {
				t.Fatalf("no answer: %v", err)
			}
			answer := make([]byte, binary.BigEndian.Uint32(head[:]))
			if _, err := io.ReadFull(c, answer); err != nil {
				t.Fatal(err)
			}
			var resp struct {
				Code uint32 `json:"c"`
			}
			if err := json.Unmarshal(answer, &resp); err != nil {
				t.Fatal(err)
			}
			if codes.Code(resp.Code) != codes.DeadlineExceeded {
				t.Errorf("answer %s, want code DeadlineExceeded", answer)
			}
		})
	}
}
