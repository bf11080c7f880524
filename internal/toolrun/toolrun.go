// Package toolrun runs the external programs the plugin depends on
// (blkid, mkfs, resize2fs, iscsiadm) in one way.
//
// What a program prints is kept for errors, redacted and bounded: every
// secret the caller names, and every match of the tool's secret pattern,
// becomes Marker before the output is cut (on a character boundary) to
// MaxOutput bytes, so a secret can never be half shown at the cut. A
// program that is not installed is one error, wrapping
// errdefs.ErrFailedPrecondition and naming the Debian package. Arguments
// never reach an error: they may come from configuration or name secret
// files.
//
// Output goes to an anonymous file rather than a pipe: a tool that leaves
// a daemon behind (a tool that forks one) would hold a pipe open and
// the run would never end.
package toolrun

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// SpawnerName is the argv[0] of the spawner (see StartSpawner): how ps
// and tests tell it from the plugin's other children (FUSE daemons, tools).
const SpawnerName = "mountplan-tool-spawner"

// SpawnerComm is the spawner's command name (/proc/PID/comm, at most 15
// bytes), apart from the plugin's: whatever finds the plugin by its
// command name finds one process.
const SpawnerComm = "mp-tool-spawner"

// Marker replaces every secret in output the plugin passes on.
const Marker = "[redacted]"

// MaxOutput bounds the output an error carries: enough for a diagnostic
// line, not a usage screen or a progress log.
const MaxOutput = 1024

// readLimit bounds what is read of a tool's output at all. It is larger
// than MaxOutput by more than any secret, so redaction sees every secret
// that could reach the bounded part whole.
const readLimit = 64 << 10

// Tool is an external program, found in PATH.
type Tool struct {
	Name string
	// Package is the Debian package that ships it, for the error that
	// says it is missing.
	Package string
	// SecretField, when set, matches text whose remainder after the first
	// submatch is secret (a password field a tool may echo); the
	// remainder is replaced by Marker.
	SecretField *regexp.Regexp
	// Env are variables (NAME=value) the program gets besides this
	// process's environment.
	Env []string
}

// Runner runs tools. Its zero value runs the real programs.
type Runner struct {
	// Exec replaces running the program (tests). It returns what the
	// program printed and its exit status (0: success), or an error when
	// it could not run at all (wrapping exec.ErrNotFound when it is
	// missing).
	Exec func(ctx context.Context, name string, args []string) (output []byte, status int, err error)
}

// Error is a run that failed: the program could not start, exited with a
// non-zero status, or was stopped by its context.
type Error struct {
	Tool string
	// Status is the exit status, -1 when the program did not exit by itself.
	Status int
	// Output is what the program printed, redacted and bounded.
	Output string
	Err    error
}

func (e *Error) Error() string {
	msg := e.Tool + ": " + e.Err.Error()
	if e.Output != "" {
		msg += ": " + e.Output
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Err }

// Status returns the exit status of a tool that ran and failed, or -1.
func Status(err error) int {
	var te *Error
	if errors.As(err, &te) {
		return te.Status
	}
	return -1
}

// Run runs t with args and returns its combined output (redacted, trimmed,
// at most readLimit bytes). secrets are values to blot out wherever they
// appear. A failure is an *Error: a missing program wraps
// errdefs.ErrFailedPrecondition, an ended ctx wraps ctx.Err(), a non-zero
// exit carries its status for the caller to map.
func (r Runner) Run(ctx context.Context, t Tool, args []string, secrets ...string) (string, error) {
	run := r.Exec
	if run == nil {
		run = func(ctx context.Context, name string, args []string) ([]byte, int, error) {
			return execute(ctx, name, args, t.Env)
		}
	}
	raw, status, err := run(ctx, t.Name, args)
	out := strings.TrimSpace(t.redact(raw, secrets))
	if err == nil && status == 0 {
		return out, nil
	}
	e := &Error{Tool: t.Name, Status: -1, Output: Bound(out)}
	switch {
	case errors.Is(err, exec.ErrNotFound):
		e.Err = fmt.Errorf("%s is not installed (Debian package %s): %w", t.Name, t.Package, errdefs.ErrFailedPrecondition)
	case ctx.Err() != nil:
		e.Err = fmt.Errorf("%w (%v)", ctx.Err(), cause(err, status))
	case err != nil:
		e.Err = err
	default:
		e.Status, e.Err = status, fmt.Errorf("exit status %d", status)
	}
	return out, e
}

func cause(err error, status int) any {
	if err != nil {
		return err
	}
	return fmt.Sprintf("exit status %d", status)
}

func (t Tool) redact(raw []byte, secrets []string) string {
	if len(raw) > readLimit {
		raw = raw[:readLimit]
	}
	s := Redact(string(raw), secrets...)
	if t.SecretField != nil {
		s = t.SecretField.ReplaceAllString(s, "${1}"+Marker)
	}
	return s
}

// Redact replaces every occurrence of each secret in s with Marker,
// longest secret first, so a secret that contains another is not left
// half shown. Empty secrets are ignored.
func Redact(s string, secrets ...string) string {
	sorted := slices.DeleteFunc(slices.Clone(secrets), func(v string) bool { return v == "" })
	slices.SortFunc(sorted, func(a, b string) int { return len(b) - len(a) })
	for _, v := range sorted {
		s = strings.ReplaceAll(s, v, Marker)
	}
	return s
}

// Bound cuts s to MaxOutput bytes on a character boundary, saying so.
func Bound(s string) string {
	if len(s) <= MaxOutput {
		return s
	}
	cut := MaxOutput
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + " …(truncated)"
}
