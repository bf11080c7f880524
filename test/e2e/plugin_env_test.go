package e2e

// Helpers of the TestPlugin* tests (and the crash test): independent views
// of the kernel (sysfs, mountinfo) and small file helpers. The plugin, its
// clients and its journal are the shared harness's (env_test.go).

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

// --- the kernel's view ---

// plugLoop is a bound loop device as sysfs shows it.
type plugLoop struct {
	Name    string // loop3
	Dev     string // 7:3
	Backing string
}

func (l plugLoop) Path() string { return "/dev/" + l.Name }

func plugSysfs(name, file string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", name, file))
	return strings.TrimSpace(string(b)), err
}

// plugLoopsBackedBy lists the bound loop devices whose backing file is path.
func plugLoopsBackedBy(t *testing.T, path string) []plugLoop {
	t.Helper()
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		real = path
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []plugLoop
	for _, f := range files {
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		b, err := plugSysfs(name, "loop/backing_file")
		b = strings.TrimSuffix(b, " (deleted)")
		if err != nil || (b != real && b != path) {
			continue
		}
		dev, err := plugSysfs(name, "dev")
		if err != nil {
			continue
		}
		out = append(out, plugLoop{Name: name, Dev: dev, Backing: b})
	}
	return out
}

// plugOneLoop asserts that exactly one loop device is backed by image and
// returns it.
func plugOneLoop(t *testing.T, image string) plugLoop {
	t.Helper()
	ls := plugLoopsBackedBy(t, image)
	if len(ls) != 1 {
		t.Fatalf("%d loop devices backed by %s, want 1: %+v", len(ls), image, ls)
	}
	return ls[0]
}

// waitNoLoop waits (the kernel detaches an autoclear device at its last
// close, which may lag) until no loop device is backed by image.
func waitNoLoop(t *testing.T, image string) {
	t.Helper()
	var ls []plugLoop
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
		ls = plugLoopsBackedBy(t, image)
		return len(ls) == 0
	}) {
		t.Errorf("loop devices still backed by %s: %+v", image, ls)
	}
}

// loopBackingFile is the backing file of loop device name ("" when none).
func loopBackingFile(name string) string {
	b, _ := plugSysfs(name, "loop/backing_file")
	return b
}

// checkStagedLoop checks the record of a staged volume against sysfs: the
// recorded device is bound to the image, with autoclear, and it is the only
// one. It returns the device.
func (e *env) checkStagedLoop(id, image string) plugLoop {
	e.t.Helper()
	st := e.loopState(id)
	l := plugOneLoop(e.t, image)
	if st.Device != l.Path() {
		e.t.Fatalf("record of %s names %s, but %s is the device backed by %s", id, st.Device, l.Path(), image)
	}
	if want := fmt.Sprintf("%d:%d", st.Identity.Major, st.Identity.Minor); want != l.Dev {
		e.t.Errorf("record of %s: identity %s, sysfs %s", id, want, l.Dev)
	}
	var fi unix.Stat_t
	if err := unix.Stat(image, &fi); err != nil {
		e.t.Fatal(err)
	}
	if st.Identity.BackingIno != fi.Ino || st.Identity.BackingDev != uint64(fi.Dev) { //nolint:unconvert
		e.t.Errorf("record of %s: backing %d:%d, image is %d:%d", id, st.Identity.BackingDev, st.Identity.BackingIno, fi.Dev, fi.Ino)
	}
	if ac, _ := plugSysfs(l.Name, "loop/autoclear"); ac != "1" {
		e.t.Errorf("%s: autoclear=%q, want 1", l.Path(), ac)
	}
	return l
}

// plugMountsOf returns the mounts of pid's namespace that use device dev
// ("major:minor").
func plugMountsOf(t *testing.T, pid int, dev string) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	infos, err := mountinfo.GetMountsFromReader(bytes.NewReader(b), nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, i := range infos {
		if fmt.Sprintf("%d:%d", i.Major, i.Minor) == dev {
			out = append(out, i.Mountpoint)
		}
	}
	return out
}

// notMounted asserts that l is mounted nowhere, neither in this process's
// mount namespace nor in the plugin's.
func (e *env) notMounted(l plugLoop) {
	e.t.Helper()
	for _, pid := range []int{os.Getpid(), e.plugin.PID()} {
		if m := plugMountsOf(e.t, pid, l.Dev); len(m) > 0 {
			e.t.Errorf("%s (%s) is mounted at %v in the mountinfo of pid %d; staging must not mount", l.Path(), l.Dev, m, pid)
		}
	}
}

func isMountPoint(t *testing.T, p string) bool {
	t.Helper()
	m, err := mountinfo.Mounted(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("mountinfo.Mounted(%s): %v", p, err)
	}
	return m
}

// plugMountOptions returns the per-mount options of the mount at p.
func plugMountOptions(t *testing.T, p string) string {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
	if err != nil || len(infos) == 0 {
		t.Fatalf("no mount at %s: %v", p, err)
	}
	return infos[len(infos)-1].Options
}

func plugStatfsTotal(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * uint64(st.Bsize)
}

func plugWriteFile(t *testing.T, p, content string) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	if _, err := f.WriteString(content); err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync %s: %v", p, err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func plugReadFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("read %s: %v", p, err)
	}
	return string(b)
}

func plugRun(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// plugMkfsExt4Image makes an ext4 image of size bytes at path holding the files
// of content (name → data), with mkfs.ext4 -d: no mount needed.
func plugMkfsExt4Image(t *testing.T, path string, size int64, content map[string]string) {
	t.Helper()
	src := t.TempDir()
	for name, data := range content {
		if err := os.WriteFile(filepath.Join(src, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	plugRun(t, "mkfs.ext4", "-q", "-F", "-d", src, path)
}

// plugCapEff reports whether pid has capability bit in its effective set.
func plugCapEff(t *testing.T, pid int, bit uint) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			var v uint64
			if _, err := fmt.Sscanf(strings.TrimSpace(hex), "%x", &v); err != nil {
				t.Fatal(err)
			}
			return v&(1<<bit) != 0
		}
	}
	t.Fatalf("no CapEff in /proc/%d/status", pid)
	return false
}
