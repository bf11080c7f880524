package fuse

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/mountplan/mountplan/pkg/daemon"
)

// layout is a volume's directory, <state-dir>/fuse/<volume-id>/, which
// explains itself so that cleanup works from the disk alone:
//
//	mnt/         the daemon's mount point; the plan binds it
//	secrets/     a tmpfs (mode 0700) with one 0600 file per secret
//	work/        private scratch space for the daemon ({workdir})
//	daemon.json  only from plugins of earlier versions, which kept the
//	             current daemon here; the journal's record holds it now
//	daemon.log   the daemon's standard output and error
type layout struct{ dir string }

func (l layout) mnt() string        { return filepath.Join(l.dir, "mnt") }
func (l layout) secrets() string    { return filepath.Join(l.dir, "secrets") }
func (l layout) work() string       { return filepath.Join(l.dir, "work") }
func (l layout) daemonFile() string { return filepath.Join(l.dir, "daemon.json") }
func (l layout) log() string        { return filepath.Join(l.dir, "daemon.log") }

// Daemon is one incarnation of a volume's daemon.
type Daemon struct {
	// Generation counts starts: 1 at stage, +1 on every restart.
	Generation int `json:"generation"`
	daemon.Proc
	// Conn is the FUSE connection ID (the mount's device number) once the
	// mount appeared; 0 before.
	Conn    uint64    `json:"conn,omitempty"`
	Started time.Time `json:"started"`
}

// readLegacyDaemon reads daemon.json, where plugins before the driver
// owned all volume state recorded a restarted daemon; a missing file gives
// the zero Daemon. The journal's record now holds the current daemon; an
// upgraded plugin still honours a newer one found here.
func (l layout) readLegacyDaemon() (Daemon, error) {
	var d Daemon
	b, err := os.ReadFile(l.daemonFile())
	if errors.Is(err, fs.ErrNotExist) {
		return d, nil
	}
	if err != nil {
		return d, err
	}
	if err := json.Unmarshal(b, &d); err != nil {
		return Daemon{}, fmt.Errorf("%s: %w", l.daemonFile(), err)
	}
	return d, nil
}

// removeFiles removes what the plugin itself wrote in the volume's
// directory and the directory, never recursively: only work/, the
// daemon's own scratch space, is emptied, through an os.Root so that
// nothing the daemon left there (a symlink) leads outside it.
func (l layout) removeFiles() error {
	var errs []error
	rm := func(p string) {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if root, err := os.OpenRoot(l.dir); err == nil {
		if err := root.RemoveAll("work"); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", l.work(), err))
		}
		root.Close()
	}
	rm(l.daemonFile())
	rm(l.log())
	rm(l.log() + ".1")
	if tmp, _ := filepath.Glob(filepath.Join(l.dir, ".daemon.json.tmp-*")); len(tmp) > 0 {
		for _, t := range tmp {
			rm(t)
		}
	}
	rm(l.secrets())
	rm(l.mnt())
	rm(l.dir)
	return errors.Join(errs...)
}
