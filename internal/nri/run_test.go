package nri

import (
	"context"
	"math"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// TestReconnectStartsOverAfterARegistration: the runtime stayed away long
// enough for the pause between tries to reach its limit, came back (the
// hook registered), and went away again: the next try comes after the
// first pause, not the limit. ContainerdKilledNRI (test/cluster) saw the
// hook come back 10s after a second containerd restart, the guard down
// all that time.
func TestReconnectStartsOverAfterARegistration(t *testing.T) {
	const first, limit = time.Millisecond, time.Second
	backoff := wait.Backoff{Duration: first, Factor: 2, Cap: limit, Steps: math.MaxInt32}
	// 11 refused tries (pauses 1ms, 2ms, ... 512ms, then the limit), a
	// connection that registers and ends, one more try.
	registers := make([]bool, 13)
	registers[11] = true
	var calls []time.Time
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reconnect(ctx, backoff, nil, func(context.Context) bool {
		calls = append(calls, time.Now())
		if len(calls) == len(registers) {
			cancel()
		}
		return registers[len(calls)-1]
	})
	if len(calls) != len(registers) {
		t.Fatalf("%d tries before the context ended, want %d", len(calls), len(registers))
	}
	if before := calls[11].Sub(calls[10]); before < limit/2 {
		t.Fatalf("pause before the registration %v: the backoff never reached its limit %v", before, limit)
	}
	if after := calls[12].Sub(calls[11]); after >= limit/2 {
		t.Errorf("pause after a registration that served %v, want the first pause (%v), not the limit (%v)", after, first, limit)
	}
}

// TestReconnectWhenTheSocketAppears: the runtime is away and the pause
// between tries is long (an hour here, 10s in the mounter); the runtime
// binds its NRI socket again, and the next try comes then, not after the
// pause. A file of another name in the directory does not end the pause.
// CRIOKilledNRI and ContainerdKilledNRI (test/cluster) saw the hook
// register 9.8s after the runtime served again.
func TestReconnectWhenTheSocketAppears(t *testing.T) {
	dir := t.TempDir()
	socket := filepath.Join(dir, "nri.sock")
	if err := os.WriteFile(socket, nil, 0o600); err != nil { // a dead runtime's socket is left behind
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	appeared := socketAppears(ctx, socket)
	calls := make(chan time.Time, 10)
	done := make(chan struct{})
	go func() {
		defer close(done)
		reconnect(ctx, wait.Backoff{Duration: time.Hour, Factor: 2, Cap: time.Hour, Steps: math.MaxInt32}, appeared, func(context.Context) bool {
			calls <- time.Now()
			return false
		})
	}()
	<-calls // the first try, at once

	if err := os.WriteFile(filepath.Join(dir, "other.sock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(socket); err != nil { // the runtime starts: the stale socket removed, a new one bound
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // room for a wrong wake-up to show
	bound := time.Now()
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	select {
	case at := <-calls:
		if at.Before(bound) {
			t.Errorf("a try at %v, before the socket was bound at %v: woken by another file or its removal", at, bound)
		}
	case <-ctx.Done():
		t.Fatal("no try after the socket was bound again: the hook waited out the pause")
	}
	cancel()
	<-done
}
