package unixrpc_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/unixrpc"
)

// countingServer serves Echo, counting the calls its handler runs.
func countingServer(t *testing.T, conns int, frame time.Duration) (string, *atomic.Int32) {
	t.Helper()
	s := unixrpc.NewServer(klog.Background())
	unixrpc.SetBounds(s, conns, frame)
	runs := &atomic.Int32{}
	unixrpc.Handle(s, "Echo", func(_ context.Context, r echoReq, _ []*os.File) (echoResp, error) {
		runs.Add(1)
		return echoResp{Text: r.Text}, nil
	})
	return serve(t, s), runs
}

func echo(ctx context.Context, c *unixrpc.Client) error {
	_, err := unixrpc.Call[echoReq, echoResp](ctx, c, "Echo", echoReq{Text: "hi"})
	return err
}

// TestConnLimit: past MaxConns open connections the server serves no new
// one until one closes; a call that gave up waiting is never run, and the
// next call is served once a slot is free.
func TestConnLimit(t *testing.T) {
	path, runs := countingServer(t, 2, time.Minute)
	var held []*unixrpc.Client
	for range 2 {
		c := unixrpc.NewClient(path)
		t.Cleanup(func() { c.Close() })
		if err := echo(withTimeout(t, 5*time.Second), c); err != nil {
			t.Fatal(err)
		}
		held = append(held, c) // its idle connection holds a slot
	}
	third := unixrpc.NewClient(path)
	defer third.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := echo(ctx, third); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a call on a third connection, past a limit of 2, was answered (%v); want it to wait until its deadline", err)
	}
	held[0].Close()
	if err := echo(withTimeout(t, 5*time.Second), third); err != nil {
		t.Fatalf("a call once a slot was free: %v", err)
	}
	if n := runs.Load(); n != 3 {
		t.Errorf("the handler ran %d times, want 3: the call that gave up waiting must not run", n)
	}
}

// TestFrameTimeout: a peer that connects and sends nothing, or a header
// claiming a large message and then nothing, is disconnected after
// FrameTimeout, and its slot serves the next client.
func TestFrameTimeout(t *testing.T) {
	for name, send := range map[string][]byte{
		"silent":       nil,
		"stalled-4MiB": append(binary.BigEndian.AppendUint32(nil, unixrpc.MaxMessage), `{"m":"Echo"`...),
	} {
		t.Run(name, func(t *testing.T) {
			path, _ := countingServer(t, 1, 200*time.Millisecond)
			peer, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			defer peer.Close()
			if _, err := peer.Write(send); err != nil {
				t.Fatal(err)
			}
			_ = peer.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := peer.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
				t.Fatalf("read from a stalled connection: %v; want EOF, the server closing it", err)
			}
			c := unixrpc.NewClient(path)
			defer c.Close()
			if err := echo(withTimeout(t, 5*time.Second), c); err != nil {
				t.Fatalf("a call after the stalled peer was let go: %v", err)
			}
		})
	}
}
