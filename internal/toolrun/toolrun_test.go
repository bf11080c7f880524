package toolrun

import (
	"context"
	"errors"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/mountplan/mountplan/internal/errdefs"
)

var sh = Tool{Name: "sh", Package: "dash"}

func TestRunOutputAndStatus(t *testing.T) {
	out, err := Runner{}.Run(t.Context(), sh, []string{"-c", "echo hello; echo oops >&2"})
	if err != nil || out != "hello\noops" {
		t.Fatalf("Run: %q, %v", out, err)
	}
	out, err = Runner{}.Run(t.Context(), sh, []string{"-c", "echo failing; exit 7"})
	if Status(err) != 7 || out != "failing" {
		t.Fatalf("Run: %q, %v (status %d), want exit 7", out, err, Status(err))
	}
	if !strings.Contains(err.Error(), "sh: exit status 7: failing") {
		t.Errorf("error %q does not name the tool, status and output", err)
	}
	if Status(errors.New("other")) != -1 {
		t.Error("Status of a foreign error is not -1")
	}
}

func TestRunEnv(t *testing.T) {
	t.Setenv("MOUNTPLAN_TOOLRUN_KEPT", "kept")
	withEnv := Tool{Name: "sh", Package: "dash", Env: []string{"MOUNTPLAN_TOOLRUN_ADDED=added"}}
	out, err := Runner{}.Run(t.Context(), withEnv, []string{"-c", `echo "$MOUNTPLAN_TOOLRUN_ADDED $MOUNTPLAN_TOOLRUN_KEPT"`})
	if err != nil || out != "added kept" {
		t.Fatalf("Run with Env: %q, %v; want the added variable and this process's", out, err)
	}
	out, err = Runner{}.Run(t.Context(), sh, []string{"-c", `echo "[$MOUNTPLAN_TOOLRUN_ADDED]"`})
	if err != nil || out != "[]" {
		t.Fatalf("Run without Env: %q, %v; another tool's Env leaked", out, err)
	}
}

func TestRunNotInstalled(t *testing.T) {
	_, err := Runner{}.Run(t.Context(), Tool{Name: "mountplan-no-such-tool", Package: "nothing"}, nil)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not installed (Debian package nothing)") {
		t.Fatalf("Run of a missing tool: %v", err)
	}
	if Status(err) != -1 {
		t.Errorf("status %d, want -1", Status(err))
	}
}

func TestRunContextEnds(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err := Runner{}.Run(ctx, sh, []string{"-c", "sleep 10"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run past its deadline: %v", err)
	}
}

// TestRunDoesNotWaitForDescendants: a tool that leaves a process behind
// holding its output (a tool that forks a daemon) still returns when the
// tool itself exits.
func TestRunDoesNotWaitForDescendants(t *testing.T) {
	start := time.Now()
	out, err := Runner{}.Run(t.Context(), sh, []string{"-c", "echo parent; (sleep 3; echo late) & exit 0"})
	if err != nil || out != "parent" {
		t.Fatalf("Run: %q, %v", out, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Run waited %v for a descendant", d)
	}
}

// TestRedactThenBound: every secret is replaced before the cut, so one
// that straddles MaxOutput is not half shown; the cut is on a character
// boundary.
func TestRedactThenBound(t *testing.T) {
	const secret = "s3cr3t-canary-value"
	field := regexp.MustCompile(`(?m)(password[ \t]*=[ \t]*)[^\n]*`)
	pad := strings.Repeat("é", (MaxOutput-5)/2) // two bytes each: the cut falls inside one
	script := "printf '%s' '" + pad + secret + "'; echo; echo 'password = hunter2'; exit 3"
	out, err := Runner{}.Run(t.Context(), Tool{Name: "sh", SecretField: field}, []string{"-c", script}, secret, "")
	if Status(err) != 3 {
		t.Fatalf("status %d: %v", Status(err), err)
	}
	for _, s := range []string{out, err.Error()} {
		if strings.Contains(s, "s3cr3t") || strings.Contains(s, "hunter2") || strings.Contains(s, "canary") {
			t.Errorf("secret shown: %q", s)
		}
		if !utf8.ValidString(s) {
			t.Errorf("cut inside a character: %q", s[len(s)-20:])
		}
	}
	if !strings.Contains(out, "password = "+Marker) || !strings.Contains(out, Marker) {
		t.Errorf("output %q lacks the marker", out)
	}
	var te *Error
	if !errors.As(err, &te) || len(te.Output) > MaxOutput+len(" …(truncated)") || !strings.HasSuffix(te.Output, "…(truncated)") {
		t.Errorf("error output not bounded: %d bytes", len(te.Output))
	}
}

func TestRedactLongestFirst(t *testing.T) {
	if got := Redact("key=abcdef", "abc", "abcdef"); got != "key="+Marker {
		t.Fatalf("Redact: %q", got)
	}
}

func TestExecSeam(t *testing.T) {
	var got []string
	r := Runner{Exec: func(_ context.Context, name string, args []string) ([]byte, int, error) {
		got = append([]string{name}, args...)
		return []byte("no such thing\n"), 0, exec.ErrNotFound
	}}
	_, err := r.Run(t.Context(), Tool{Name: "blkid", Package: "util-linux"}, []string{"-p", "/dev/x"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || strings.Join(got, " ") != "blkid -p /dev/x" {
		t.Fatalf("seam: %v %v", got, err)
	}
}
