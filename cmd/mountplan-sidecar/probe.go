package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter/service"
)

// runProbe asks the mounter serving at --endpoint for an answer (its
// client's Ping: a call that looks at nothing) and says in one line whether
// it came: kubelet's liveness probe of the mounter's container runs it, so
// that a serve that lives but no longer answers is restarted. The error
// (exit status 1) says which socket and why, for the pod's events.
func runProbe(ctx context.Context, args []string, out io.Writer) error {
	fs := newFlagSet("probe")
	ep := fs.String("endpoint", "", "the mounter's socket, as serve's --endpoint, unix:///path (required)")
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for the answer: keep it below the probe's timeoutSeconds, so that a silent mounter fails with this reason rather than a kill")
	if err := parse(fs, args, "endpoint"); err != nil {
		return err
	}
	path, err := endpoint.Path(*ep)
	if err != nil {
		return fmt.Errorf("--endpoint: %w: %w", err, errUsage)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := service.NewClient(path)
	defer c.Close()
	start := time.Now()
	if err := c.Ping(ctx); err != nil {
		// Unavailable whatever the cause (a timeout too): the caller's
		// question is only whether it answers.
		return fmt.Errorf("the mounter at %s does not answer (after %v): %v: %w", path, time.Since(start).Round(time.Millisecond), err, errdefs.ErrUnavailable)
	}
	fmt.Fprintf(out, "the mounter at %s answered in %v\n", path, time.Since(start).Round(time.Microsecond))
	return nil
}
