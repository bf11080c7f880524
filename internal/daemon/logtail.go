package daemon

import (
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/toolrun"
)

// Redactor hides secret values in text that came from a daemon (its log
// tail quoted in an error): tools may echo what they were given.
type Redactor []string

// RedactorOf builds a redactor from secret values: each value, and each
// of its lines long enough to be recognisable (a key file's lines).
func RedactorOf(values []string) Redactor {
	var r Redactor
	for _, v := range values {
		if v = strings.TrimSpace(v); len(v) >= 4 {
			r = append(r, v)
		}
		for _, line := range strings.Split(v, "\n") {
			if line = strings.TrimSpace(line); len(line) >= 8 {
				r = append(r, line)
			}
		}
	}
	return r
}

// Apply replaces each value with toolrun's marker, longest first, so a
// line inside a whole value is not left half shown.
func (r Redactor) Apply(s string) string { return toolrun.Redact(s, r...) }

// LogTail returns the last lines of a daemon's log at path (opened
// without following a symlink), at most n bytes, with secrets redacted
// and control characters replaced: it is quoted in errors.
func LogTail(path string, n int64, r Redactor) string {
	f, err := OpenNoSymlinks(path, unix.O_RDONLY, 0)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	// Read more than shown, so a secret cut at the window's start is still
	// recognised before it is cut again.
	window := n + 64<<10
	off := max(fi.Size()-window, 0)
	b := make([]byte, fi.Size()-off)
	k, _ := f.ReadAt(b, off)
	s := r.Apply(string(b[:k]))
	if int64(len(s)) > n {
		s = s[int64(len(s))-n:]
		if i := strings.IndexByte(s, '\n'); i >= 0 {
			s = s[i+1:]
		}
	}
	s = strings.ReplaceAll(s, "\r\n", "\n")
	s = strings.Map(func(c rune) rune {
		if c == '\n' || c == '\t' || c >= ' ' && c != 0x7f {
			return c
		}
		return '?'
	}, s)
	return strings.TrimSpace(s)
}
