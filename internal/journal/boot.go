package journal

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/mountplan/mountplan/internal/fsutil"
)

// BootIDPath is where the kernel shows the ID of the running boot: a new
// random UUID at every boot.
const BootIDPath = "/proc/sys/kernel/random/boot_id"

// CurrentBoot returns the ID of the running boot.
func CurrentBoot() (string, error) { return BootFrom(BootIDPath)() }

// BootFrom returns a reader of the boot ID in the file at path: the
// kernel's (BootIDPath), or a file a test rewrites to play a reboot the
// kernel does not see (a node in namespaces of a host that stays up).
func BootFrom(path string) func() (string, error) {
	return func() (string, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("journal: boot id: %w", err)
		}
		id := strings.TrimSpace(string(b))
		if id == "" {
			return "", fmt.Errorf("journal: boot id: %s is empty", path)
		}
		return id, nil
	}
}

// Boot is the record of the boot the driver last ran in
// (<state-dir>/boot): a driver that starts in another boot knows that
// every device, session, daemon and mount its records name is gone.
type Boot struct{ path string }

// OpenBoot returns the boot record of stateDir.
func OpenBoot(stateDir string) *Boot { return &Boot{path: filepath.Join(stateDir, "boot")} }

// Last returns the boot recorded, "" when none is (a new state dir, or
// one of a version that did not record it).
func (b *Boot) Last() (string, error) {
	data, err := os.ReadFile(b.path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("journal: %w", err)
	}
	return strings.TrimSpace(string(data)), nil
}

// Record writes id as the boot the driver runs in, durably: the next
// boot must find it whatever the machine did in between.
func (b *Boot) Record(id string) error {
	if id == "" || strings.ContainsAny(id, "\n/") {
		return fmt.Errorf("journal: boot id %q", id)
	}
	if err := fsutil.WriteFileAtomic(b.path, []byte(id+"\n"), 0o600, true); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	// Temp files of a write a crash interrupted: only the driver's start
	// writes this record, and it is past that.
	temps, err := fsutil.AtomicTemps(filepath.Dir(b.path))
	var errs []error
	for _, p := range temps[filepath.Base(b.path)] {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(err, errors.Join(errs...))
}
