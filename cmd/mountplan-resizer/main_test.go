package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestHealthEndpoint: with --health-address the resizer answers /healthz
// (200) for kubelet's liveness probe while it runs; without it nothing
// listens.
func TestHealthEndpoint(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	addr, done, err := serveHealth(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(string(body), "ok") {
		t.Errorf("/healthz answered %d %q, want 200 ok", resp.StatusCode, body)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("health server: %v", err)
	}
	if _, err := http.Get("http://" + addr + "/healthz"); err == nil {
		t.Error("/healthz still answers after the resizer stopped")
	}

	addr, done, err = serveHealth(context.Background(), "")
	if err != nil || addr != "" || done != nil {
		t.Errorf(`serveHealth("") = %q, %v, %v: want off`, addr, done, err)
	}
	if _, _, err := serveHealth(context.Background(), "no-port"); err == nil {
		t.Error("a bad --health-address was accepted")
	}
}
