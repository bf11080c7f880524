package loopdev

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/testenv"
)

// backingFiles maps loopN to its backing file for every bound loop device.
func backingFiles(tb testing.TB) map[string]string {
	tb.Helper()
	paths, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		tb.Fatal(err)
	}
	m := make(map[string]string, len(paths))
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // detached while listing
		}
		m[strings.Split(p, "/")[3]] = strings.TrimSpace(string(b))
	}
	return m
}

// mountsUnder lists mount points at or below one of roots.
func mountsUnder(tb testing.TB, roots []string) []string {
	tb.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	var found []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && underAny(fields[4], roots) {
			found = append(found, fields[4])
		}
	}
	return found
}

func underAny(p string, roots []string) bool {
	for _, r := range roots {
		if p == r || strings.HasPrefix(p, r+"/") {
			return true
		}
	}
	return false
}

// noLeaks snapshots the bound loop devices now and, in a cleanup that runs
// after the test's own cleanups, fails if a device added since is backed by
// a file under roots, or if anything is mounted under roots. Devices of
// other files are only logged: other packages' root tests may run at the
// same time on this machine.
func noLeaks(tb testing.TB, roots ...string) {
	tb.Helper()
	before := backingFiles(tb)
	tb.Cleanup(func() {
		var leaked []string
		deadline := time.Now().Add(2 * time.Second)
		for {
			leaked = leaked[:0]
			for dev, file := range backingFiles(tb) {
				if before[dev] != file && underAny(strings.TrimSuffix(file, " (deleted)"), roots) {
					leaked = append(leaked, dev+"="+file)
				}
			}
			if len(leaked) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if len(leaked) > 0 {
			tb.Errorf("leaked loop devices: %v", leaked)
		}
		if m := mountsUnder(tb, roots); len(m) > 0 {
			tb.Errorf("leaked mounts: %v", m)
		}
	})
}

// testDir returns a fresh directory under t.TempDir() and arms noLeaks on it.
func testDir(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	noLeaks(tb, dir)
	return dir
}

// diskDir returns a fresh directory on a disk-backed filesystem, where
// O_DIRECT works, or stops the test (testenv.Missing).
func diskDir(tb testing.TB) string {
	tb.Helper()
	dir, err := os.MkdirTemp("/var/tmp", "loopdev-test-")
	if err != nil {
		testenv.Missing(tb, "a writable /var/tmp: %v", err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		tb.Fatal(err)
	}
	if st.Type == unix.TMPFS_MAGIC || st.Type == unix.RAMFS_MAGIC {
		testenv.Missing(tb, "a disk-backed /var/tmp (O_DIRECT); it is tmpfs or ramfs here")
	}
	noLeaks(tb, dir)
	return dir
}

// mountFS mounts a fresh instance of fstype (tmpfs, ramfs) on a new
// directory and unmounts it in cleanup.
func mountFS(tb testing.TB, fstype string) string {
	tb.Helper()
	dir := filepath.Join(tb.TempDir(), fstype)
	if err := os.Mkdir(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	noLeaks(tb, dir) // registered first: runs after the unmount below
	if err := unix.Mount(fstype, dir, fstype, unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		testenv.Missing(tb, "a mountable %s: %v", fstype, err)
	}
	tb.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			tb.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

// sparseImage creates a sparse file of size bytes in dir.
func sparseImage(tb testing.TB, dir, name string, size int64) string {
	tb.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		tb.Fatal(err)
	}
	return p
}

func mustAttach(tb testing.TB, img string, o Options) *Device {
	tb.Helper()
	d, err := Attach(tb.Context(), img, o)
	if err != nil {
		tb.Fatalf("Attach(%s, %+v): %v", img, o, err)
	}
	tb.Cleanup(func() {
		if err := d.Detach(); err != nil {
			tb.Errorf("cleanup Detach %s: %v", d.Path, err)
		}
	})
	return d
}

func sysfs(tb testing.TB, d *Device, attr string) string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(d.Path), attr))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// waitGone waits until /sys shows d unbound; the kernel unbinds in the
// release of the last opener, which a probing process may delay.
func waitGone(tb testing.TB, d *Device) {
	tb.Helper()
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if sysfs(tb, d, "loop/backing_file") == "" {
			return
		}
	}
	tb.Fatalf("%s still bound to %s", d.Path, sysfs(tb, d, "loop/backing_file"))
}

func isBound(tb testing.TB, d *Device, img string) bool {
	tb.Helper()
	return sysfs(tb, d, "loop/backing_file") == img
}

// rawClear issues LOOP_CLR_FD through a separate fd, as another tool would.
func rawClear(tb testing.TB, path string) {
	tb.Helper()
	f, err := os.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil {
		tb.Fatalf("raw LOOP_CLR_FD %s: %v", path, err)
	}
}

func openFds(tb testing.TB) int {
	tb.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	return len(es)
}

func run(tb testing.TB, name string, args ...string) {
	tb.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		tb.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}
