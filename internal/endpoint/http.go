package endpoint

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"
)

// ServeHTTP serves h on lis until ctx ends, then shuts down gracefully
// (metrics, health).
func ServeHTTP(ctx context.Context, lis net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
