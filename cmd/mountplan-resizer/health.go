package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"

	"github.com/mountplan/mountplan/internal/endpoint"
)

// serveHealth serves /healthz on address for kubelet's liveness probe of
// the resizer's container, until ctx ends; "" serves nothing (addr "" and
// done nil). It listens before it returns: a bad --health-address stops
// the resizer rather than failing every probe.
//
// The answer is 200 whenever the process answers at all, as
// controller-runtime's healthz.Ping: what the resizer waits on (the API
// server's watches, the plugin's socket) is retried by client-go and gRPC
// on their own, and a restart would not bring either back, only restart
// the informers' lists. A hung or wedged process is what a restart fixes,
// and that one does not answer.
func serveHealth(ctx context.Context, address string) (addr string, done <-chan error, err error) {
	if address == "" {
		return "", nil, nil
	}
	lis, err := net.Listen("tcp", address)
	if err != nil {
		return "", nil, fmt.Errorf("--health-address: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok\n")
	})
	ch := make(chan error, 1)
	go func() { ch <- endpoint.ServeHTTP(ctx, lis, mux) }()
	return lis.Addr().String(), ch, nil
}
