package mountns

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

func nsPath(pid string) string { return "/proc/" + pid + "/ns/mnt" }

// IdentityOf returns the identity of process pid's mount namespace (as the
// caller's /proc sees it). It fails with errdefs.ErrNotFound when the
// process does not exist.
func IdentityOf(pid int) (plan.Namespace, error) {
	if pid <= 0 {
		return plan.Namespace{}, fmt.Errorf("pid %d: %w", pid, errdefs.ErrInvalidArgument)
	}
	f, err := openNS(strconv.Itoa(pid))
	if err != nil {
		return plan.Namespace{}, err
	}
	defer f.Close()
	return identityOf(f)
}

// openNS opens /proc/PID/ns/mnt; a process that does not exist (or has
// exited and dropped its namespaces) is errdefs.ErrNotFound.
func openNS(pid string) (*os.File, error) {
	f, err := openFile(nsPath(pid), unix.O_RDONLY)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("mount namespace of pid %s: %w", pid, errdefs.ErrNotFound)
		}
		return nil, fmt.Errorf("mount namespace of pid %s: %w", pid, err)
	}
	return f, nil
}

// identityOf reads the identity of the namespace f (an nsfs file) refers to.
func identityOf(f *os.File) (plan.Namespace, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return plan.Namespace{}, &os.PathError{Op: "fstat", Path: f.Name(), Err: err}
	}
	id, err := unix.IoctlGetUint64(int(f.Fd()), unix.NS_GET_MNTNS_ID)
	if err != nil {
		id = 0 // an older kernel: the inode is all there is
	}
	return plan.Namespace{Inode: st.Ino, ID: id}, nil
}

// Find returns a process that is in the namespace id names, searching all
// of /proc: a container's namespace outlives any one of its processes.
// Candidates are picked by inode with a cheap stat and confirmed by
// namespace ID when id knows it (without it, any namespace that now has the
// inode is taken). ok is false when no process is in it: the namespace is
// gone. An error means /proc could not be read, and nothing can be told.
// The process may exit at any time; open it with OpenPID(pid, id), which
// checks again, and search again if that fails.
func Find(id plan.Namespace) (pid int, ok bool, err error) {
	if id == (plan.Namespace{}) {
		return 0, false, nil
	}
	d, err := os.Open("/proc")
	if err != nil {
		return 0, false, err
	}
	defer d.Close()
	for {
		names, err := d.Readdirnames(256)
		for _, name := range names {
			if pid, ok := candidate(name, id); ok {
				return pid, true, nil
			}
		}
		if errors.Is(err, io.EOF) {
			return 0, false, nil
		}
		if err != nil {
			return 0, false, fmt.Errorf("find mount namespace %s: %w", id, err)
		}
	}
}

// candidate reports whether /proc/name is a process in namespace id.
func candidate(name string, id plan.Namespace) (int, bool) {
	pid, err := strconv.Atoi(name)
	if err != nil || pid <= 0 {
		return 0, false
	}
	if id.Inode != 0 {
		var st unix.Stat_t
		if unix.Stat(nsPath(name), &st) != nil || st.Ino != id.Inode {
			return 0, false
		}
	}
	got, err := IdentityOf(pid)
	return pid, err == nil && id.Matches(got)
}

// OpenIdentity opens the namespace id names through any process still in it
// (see Find). It fails with errdefs.ErrNotFound when no process is left in
// it: the namespace is gone and the kernel dropped its mounts with it.
func OpenIdentity(id plan.Namespace) (*Namespace, error) {
	if id == (plan.Namespace{}) {
		return nil, fmt.Errorf("open a mount namespace of unknown identity: %w", errdefs.ErrInvalidArgument)
	}
	// Each try fails only when the process found exited (or was replaced)
	// between the search and the open; the next search skips it.
	const tries = 5
	var last error // not wrapped: it may be ErrNotFound, and the namespace lives
	for range tries {
		pid, ok, err := Find(id)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("no process is left in mount namespace %s: %w", id, errdefs.ErrNotFound)
		}
		ns, err := OpenPID(pid, id)
		if err == nil {
			return ns, nil
		}
		if !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrFailedPrecondition) {
			return nil, err
		}
		last = err
	}
	return nil, fmt.Errorf("mount namespace %s: its processes kept exiting while it was opened (%v): %w", id, last, errdefs.ErrUnavailable)
}
