package nri

import (
	"context"
	"math"
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
	reconnect(ctx, backoff, func(context.Context) bool {
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
