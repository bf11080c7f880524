//go:build linux

// Package blockingtest holds what tests of calls that must not hang
// share: a FUSE mount whose daemon never answers.
package blockingtest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Hung is a FUSE filesystem mounted by HungFuse: nothing ever reads its
// device, so every call that reaches it (a stat of its root, a lookup in
// it) sleeps in the kernel until Abort.
type Hung struct {
	Dir  string
	conn string // /sys/fs/fuse/connections/<minor>
	once sync.Once
	dev  *os.File
	err  error
}

// HungFuse mounts at dir a FUSE filesystem whose daemon never answers: a
// hung sshfs, as a pod's volume or a hostPath may be. The test's cleanup
// aborts it and unmounts it (register later cleanups that need it gone
// after calling HungFuse, or call Abort).
func HungFuse(t testing.TB, dir string) *Hung {
	t.Helper()
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", dev.Fd())
	if err := unix.Mount("mountplan-hung", dir, "fuse.hung", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		dev.Close()
		t.Fatalf("mount a FUSE filesystem at %s: %v", dir, err)
	}
	h := &Hung{Dir: dir, dev: dev}
	// Not a stat of dir: that is what hangs. The mount table names the
	// connection (its device's minor).
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err == nil && len(ms) == 1 {
		h.conn = filepath.Join("/sys/fs/fuse/connections", fmt.Sprint(ms[0].Minor))
	}
	t.Cleanup(func() {
		if err := h.Abort(); err != nil {
			t.Error(err)
		}
	})
	return h
}

// Abort aborts the connection (through fusectl when it is mounted, and by
// closing the device's only descriptor), which ends every call blocked on
// it with ENOTCONN, and detaches the mount. Idempotent.
func (h *Hung) Abort() error {
	h.once.Do(func() {
		if h.conn != "" {
			if err := os.WriteFile(filepath.Join(h.conn, "abort"), []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
				h.err = fmt.Errorf("abort the FUSE connection of %s: %w", h.Dir, err)
			}
		}
		h.dev.Close()
		if err := unix.Unmount(h.Dir, unix.MNT_DETACH); err != nil {
			h.err = errors.Join(h.err, fmt.Errorf("unmount %s: %w", h.Dir, err))
		}
	})
	return h.err
}
