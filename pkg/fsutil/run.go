package fsutil

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	utilexec "k8s.io/utils/exec"

	"github.com/mountplan/mountplan/pkg/errdefs"
)

// maxOutput bounds the tool output kept in an error: enough for the
// diagnostic line, not a usage screen or a progress log.
const maxOutput = 1024

// toolError is a failed tool run. It names the tool and the device, keeps
// the (bounded) output and unwraps to the cause.
type toolError struct {
	tool, device string
	code         int // exit status, -1 when the tool did not exit
	output       string
	err          error
}

func (e *toolError) Error() string {
	msg := "fsutil: " + e.tool + " " + e.device + ": " + e.err.Error()
	if e.output != "" {
		msg += ": " + e.output
	}
	return msg
}

func (e *toolError) Unwrap() error { return e.err }

// run runs tool with args and returns its combined output. A non-zero exit
// is a *toolError carrying the exit code; a cancelled or expired ctx wraps
// ctx.Err(); a missing binary wraps ErrFailedPrecondition.
func (t tools) run(ctx context.Context, device, tool string, args ...string) ([]byte, error) {
	out, err := t.exec.CommandContext(ctx, tool, args...).CombinedOutput()
	if err == nil {
		return out, nil
	}
	te := &toolError{tool: tool, device: device, code: -1, output: bounded(out), err: err}
	var ee utilexec.ExitError
	switch {
	case ctx.Err() != nil:
		te.err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	case errors.Is(err, utilexec.ErrExecutableNotFound):
		te.err = fmt.Errorf("%w: %w", errdefs.ErrFailedPrecondition, err)
	case errors.As(err, &ee):
		te.code = ee.ExitStatus()
	}
	return out, te
}

// exitCode returns the exit status of a tool that ran and failed, or -1.
func exitCode(err error) int {
	var te *toolError
	if errors.As(err, &te) {
		return te.code
	}
	return -1
}

// bounded trims tool output to maxOutput bytes on a rune boundary.
func bounded(out []byte) string {
	s := strings.TrimSpace(string(out))
	if len(s) <= maxOutput {
		return s
	}
	cut := maxOutput
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + " …(truncated)"
}
