package fuse

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/pkg/daemon"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

// maxSecret bounds one secret; the tmpfs holding them is 1 MiB.
const maxSecret = 64 << 10

// mountSecrets mounts a small tmpfs at dir for a volume's secret files:
// mode 0700 (owned by the daemon's user), nosuid, nodev, noexec. Secrets
// thus never touch a disk, and unmounting it removes them all at once.
func mountSecrets(dir string, runAs *daemon.User) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	data := "size=1m,nr_inodes=64,mode=0700"
	if runAs != nil {
		data += fmt.Sprintf(",uid=%d,gid=%d", runAs.UID, runAs.GID)
	}
	if err := unix.Mount("mountplan-secrets", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, data); err != nil {
		return fmt.Errorf("mount tmpfs for secrets at %s: %w", dir, err)
	}
	return nil
}

// writeSecrets writes each given secret into its own file (mode 0600,
// created exclusively, never through a symlink).
func writeSecrets(dir string, secrets map[string]string, given map[string]bool, runAs *daemon.User) error {
	names := make([]string, 0, len(given))
	for n := range given {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		p := filepath.Join(dir, n)
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return fmt.Errorf("secret file %s: %w", p, err)
		}
		_, err = f.WriteString(secrets[n])
		if err == nil && runAs != nil {
			err = f.Chown(int(runAs.UID), int(runAs.GID))
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			// The error of a write names the file, not what was written.
			return fmt.Errorf("secret file %s: %w", p, err)
		}
	}
	return nil
}

// redactor hides secret values in text that came from a daemon (its log
// tail quoted in an error): tools may echo what they were given.
type redactor []string

// redactorOf builds a redactor from secret values: each value, and each
// of its lines long enough to be recognisable (a key file's lines).
func redactorOf(values []string) redactor {
	var r redactor
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

// readRedactor reads the secret files of a staged volume.
func readRedactor(dir string) redactor {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var vals []string
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(dir, e.Name())); err == nil {
			vals = append(vals, string(b))
		}
	}
	return redactorOf(vals)
}

// apply replaces each value with toolrun's marker, longest first, so a
// line inside a whole value is not left half shown.
func (r redactor) apply(s string) string { return toolrun.Redact(s, r...) }

// logTail returns the last lines of a daemon's log, at most n bytes, with
// secrets redacted and control characters replaced: it is quoted in
// errors.
func logTail(path string, n int64, r redactor) string {
	f, err := os.Open(path)
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
	s := r.apply(string(b[:k]))
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
