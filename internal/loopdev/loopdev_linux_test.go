package loopdev

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/testenv"
)

const mib = 1 << 20

func TestAttachReadWrite(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "rw.img", 16*mib)
	d := mustAttach(t, img, Options{})

	if !isBound(t, d, img) || sysfs(t, d, "ro") != "0" || d.ReadOnly {
		t.Fatalf("%s: backing %q ro %q ReadOnly %v", d.Path, sysfs(t, d, "loop/backing_file"), sysfs(t, d, "ro"), d.ReadOnly)
	}
	var st unix.Stat_t
	if err := unix.Stat(img, &st); err != nil {
		t.Fatal(err)
	}
	if d.Identity.BackingDev != uint64(st.Dev) || d.Identity.BackingIno != st.Ino {
		t.Fatalf("identity %+v, backing file %d:%d", d.Identity, st.Dev, st.Ino)
	}
	if d.Identity.Major != 7 || filepath.Base(d.Path) != "loop"+strconv.Itoa(d.Number) {
		t.Fatalf("device %s number %d identity %+v", d.Path, d.Number, d.Identity)
	}
	writeThrough(t, d, img)

	if err := d.Detach(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
	if err := d.Detach(); err != nil {
		t.Fatalf("second Detach: %v", err)
	}
	if err := d.SetCapacity(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("SetCapacity after Detach: %v, want ErrFailedPrecondition", err)
	}
}

// writeThrough writes through the device and reads it back from the image.
func writeThrough(t *testing.T, d *Device, img string) {
	t.Helper()
	data := bytes.Repeat([]byte("mountplan"), 512)[:4096]
	w, err := os.OpenFile(d.Path, os.O_WRONLY|os.O_SYNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteAt(data, 8192); err != nil {
		t.Fatal(err)
	}
	w.Close()
	got := make([]byte, len(data))
	r, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("image does not hold what was written through %s (err %v)", d.Path, err)
	}
}

func TestAttachReadOnly(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "ro.img", 16*mib)
	d := mustAttach(t, img, Options{ReadOnly: true})
	if !d.ReadOnly || sysfs(t, d, "ro") != "1" {
		t.Fatalf("ReadOnly %v, sysfs ro %q", d.ReadOnly, sysfs(t, d, "ro"))
	}
	// The kernel lets a read-only device be opened for write and refuses
	// the write itself.
	f, err := os.OpenFile(d.Path, os.O_WRONLY, 0)
	if err != nil {
		return
	}
	defer f.Close()
	if _, err := f.WriteAt(make([]byte, 4096), 0); err == nil {
		t.Fatalf("wrote to read-only %s", d.Path)
	}
}

// TestAttachHeldFdIsReadOnly: the fd a RW Device holds is not a writer, so
// it never blocks a mount where the kernel refuses writers on mounted
// devices (CONFIG_BLK_DEV_WRITE_MOUNTED=n).
func TestAttachHeldFdIsReadOnly(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "held.img", 16*mib)
	d := mustAttach(t, img, Options{})
	fl, err := unix.FcntlInt(d.f.Fd(), unix.F_GETFL, 0)
	if err != nil {
		t.Fatal(err)
	}
	if fl&unix.O_ACCMODE != unix.O_RDONLY {
		t.Fatalf("held fd flags %#x, want O_RDONLY", fl)
	}
	fdfl, err := unix.FcntlInt(d.f.Fd(), unix.F_GETFD, 0)
	if err != nil || fdfl&unix.FD_CLOEXEC == 0 {
		t.Fatalf("held fd without FD_CLOEXEC (%#x, %v)", fdfl, err)
	}
}

func TestDirectIO(t *testing.T) {
	testenv.RequireRoot(t)
	t.Run("disk", func(t *testing.T) {
		img := sparseImage(t, diskDir(t), "dio.img", 16*mib)
		d := mustAttach(t, img, Options{DirectIO: true})
		if !d.DirectIO || sysfs(t, d, "loop/dio") != "1" {
			t.Fatalf("DirectIO %v, sysfs dio %q on a disk-backed file", d.DirectIO, sysfs(t, d, "loop/dio"))
		}
		writeThrough(t, d, img)
	})
	t.Run("ramfs-fallback", func(t *testing.T) {
		// ramfs has no direct I/O: open(O_DIRECT) fails with EINVAL.
		img := sparseImage(t, mountFS(t, "ramfs"), "dio.img", 4*mib)
		d := mustAttach(t, img, Options{DirectIO: true})
		if d.DirectIO || sysfs(t, d, "loop/dio") != "0" {
			t.Fatalf("DirectIO %v, sysfs dio %q on ramfs", d.DirectIO, sysfs(t, d, "loop/dio"))
		}
		writeThrough(t, d, img)
	})
	t.Run("tmpfs", func(t *testing.T) {
		// Whether tmpfs takes O_DIRECT depends on the kernel (6.6+ does);
		// the Device must report what the kernel does either way.
		img := sparseImage(t, mountFS(t, "tmpfs"), "dio.img", 4*mib)
		d := mustAttach(t, img, Options{DirectIO: true})
		if d.DirectIO != (sysfs(t, d, "loop/dio") == "1") {
			t.Fatalf("DirectIO %v disagrees with sysfs dio %q", d.DirectIO, sysfs(t, d, "loop/dio"))
		}
		t.Logf("tmpfs: direct I/O in effect: %v", d.DirectIO)
		writeThrough(t, d, img)
	})
	t.Run("not-asked", func(t *testing.T) {
		img := sparseImage(t, diskDir(t), "buffered.img", 4*mib)
		d := mustAttach(t, img, Options{})
		if d.DirectIO || sysfs(t, d, "loop/dio") != "0" {
			t.Fatalf("DirectIO %v, sysfs dio %q without asking", d.DirectIO, sysfs(t, d, "loop/dio"))
		}
	})
}

func TestAutoclearOnClose(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "ac.img", 16*mib)
	d, err := Attach(t.Context(), img, Options{Autoclear: true})
	if err != nil {
		t.Fatal(err)
	}
	if sysfs(t, d, "loop/autoclear") != "1" {
		t.Fatalf("autoclear %q", sysfs(t, d, "loop/autoclear"))
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
	if err := d.Detach(); err != nil {
		t.Fatalf("Detach after autoclear: %v", err)
	}
}

// TestAutoclearKeptByMount: a mount keeps an autoclear device after the
// plugin's fd is gone (a plugin crash must not break a running container),
// and the kernel unbinds it at unmount.
func TestAutoclearKeptByMount(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireCommands(t, "mkfs.ext4")
	dir := testDir(t)
	img := sparseImage(t, dir, "ac.img", 64*mib)
	d, err := Attach(t.Context(), img, Options{Autoclear: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Detach() })
	run(t, "mkfs.ext4", "-F", "-q", d.Path)
	mnt := mountDevice(t, d, filepath.Join(dir, "mnt"))
	d.Close()
	if !isBound(t, d, img) {
		t.Fatalf("%s unbound while mounted", d.Path)
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
}

// TestDetachWhileMounted: Detach of a mounted device succeeds and the
// kernel unbinds it at unmount (LOOP_CLR_FD is lazy while others hold it).
func TestDetachWhileMounted(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireCommands(t, "mkfs.ext4")
	dir := testDir(t)
	img := sparseImage(t, dir, "busy.img", 64*mib)
	d := mustAttach(t, img, Options{})
	run(t, "mkfs.ext4", "-F", "-q", d.Path)
	mnt := mountDevice(t, d, filepath.Join(dir, "mnt"))
	if err := d.Detach(); err != nil {
		t.Fatalf("Detach while mounted: %v", err)
	}
	if !isBound(t, d, img) {
		t.Fatalf("%s unbound while mounted", d.Path)
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
}

// mountDevice mounts d's ext4 at mnt; cleanup unmounts it if still mounted.
func mountDevice(t *testing.T, d *Device, mnt string) string {
	t.Helper()
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(d.Path, mnt, "ext4", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, 0) })
	return mnt
}

func TestAdopt(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "adopt.img", 16*mib)
	d := mustAttach(t, img, Options{ReadOnly: true})

	a, err := Adopt(d.Path, d.Identity)
	if err != nil {
		t.Fatal(err)
	}
	if a.Path != d.Path || a.Number != d.Number || a.Identity != d.Identity || !a.ReadOnly {
		t.Fatalf("adopted %+v, attached %+v", a, d)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}

	wrong := map[string]Identity{
		"inode": {d.Identity.Major, d.Identity.Minor, d.Identity.BackingDev, d.Identity.BackingIno + 1},
		"dev":   {d.Identity.Major, d.Identity.Minor, d.Identity.BackingDev + 1, d.Identity.BackingIno},
		"minor": {d.Identity.Major, d.Identity.Minor + 1, d.Identity.BackingDev, d.Identity.BackingIno},
	}
	for name, id := range wrong {
		if a, err := Adopt(d.Path, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Adopt with wrong %s: %v, %v; want ErrNotFound", name, a, err)
		}
	}
	for _, path := range []string{"/dev/loop-does-not-exist", img, "/dev/null"} {
		if _, err := Adopt(path, d.Identity); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Adopt(%s): %v, want ErrNotFound", path, err)
		}
	}
	if _, err := Adopt(d.Path, Identity{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Adopt with empty identity: %v, want ErrInvalidArgument", err)
	}

	if err := d.Detach(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, d)
	if _, err := Adopt(d.Path, d.Identity); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Adopt of a detached device: %v, want ErrNotFound", err)
	}
}

func TestFindByBacking(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testDir(t)
	img := sparseImage(t, dir, "find.img", 16*mib)
	other := sparseImage(t, dir, "other.img", 16*mib)
	d1 := mustAttach(t, img, Options{ReadOnly: true})
	d2 := mustAttach(t, img, Options{ReadOnly: true})
	mustAttach(t, other, Options{})

	// Another name for the same inode must find the same devices.
	link := filepath.Join(dir, "link.img")
	if err := os.Link(img, link); err != nil {
		t.Fatal(err)
	}
	found, err := FindByBacking(link)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, f := range found {
		got[f.Path] = true
		if f.Identity != d1.Identity && f.Identity != d2.Identity {
			t.Errorf("found %s with identity %+v", f.Path, f.Identity)
		}
		f.Close()
	}
	if len(found) != 2 || !got[d1.Path] || !got[d2.Path] {
		t.Fatalf("found %v, want %s and %s", got, d1.Path, d2.Path)
	}
	if _, err := FindByBacking(filepath.Join(dir, "missing.img")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("FindByBacking(missing): %v, want ErrNotFound", err)
	}
}

// TestDetachIdentity: Detach touches a device only while it still carries
// the recorded binding.
func TestDetachIdentity(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testDir(t)
	imgA := sparseImage(t, dir, "a.img", 16*mib)
	imgB := sparseImage(t, dir, "b.img", 16*mib)

	t.Run("reused-number", func(t *testing.T) {
		a := mustAttach(t, imgA, Options{})
		// Another tool clears A. The kernel defers the unbind while A's
		// fd is held (it only sets autoclear), so the number cannot be
		// reused until that fd is gone.
		rawClear(t, a.Path)
		if !isBound(t, a, imgA) {
			t.Fatalf("%s unbound while its Device holds it", a.Path)
		}
		a.Close()
		waitGone(t, a)
		b := mustAttach(t, imgB, Options{})
		if b.Path != a.Path {
			t.Logf("number not reused (%s then %s): another attacher raced; the check still holds", a.Path, b.Path)
		}
		if err := a.Detach(); err != nil {
			t.Fatalf("stale Detach: %v", err)
		}
		if !isBound(t, b, imgB) {
			t.Fatalf("stale Detach of %s touched %s's binding", a.Path, imgB)
		}
	})
	t.Run("lazily-cleared-while-held", func(t *testing.T) {
		a := mustAttach(t, imgA, Options{})
		rawClear(t, a.Path)
		if err := a.Detach(); err != nil {
			t.Fatal(err)
		}
		waitGone(t, a)
	})
	t.Run("after-close", func(t *testing.T) {
		a := mustAttach(t, imgA, Options{})
		a.Close()
		if !isBound(t, a, imgA) {
			t.Fatalf("%s without autoclear unbound by Close", a.Path)
		}
		if err := a.Detach(); err != nil {
			t.Fatal(err)
		}
		waitGone(t, a)
	})
}

func TestAttachConcurrent(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testDir(t)
	const n = 8
	devs := make([]*Device, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		img := sparseImage(t, dir, "c"+strconv.Itoa(i)+".img", 4*mib)
		wg.Go(func() { devs[i], errs[i] = Attach(t.Context(), img, Options{Autoclear: true}) })
	}
	wg.Wait()
	seen := map[string]int{}
	for i, d := range devs {
		if errs[i] != nil {
			t.Errorf("attacher %d: %v", i, errs[i])
			continue
		}
		t.Cleanup(func() { d.Detach() })
		if j, dup := seen[d.Path]; dup {
			t.Errorf("attachers %d and %d both got %s", j, i, d.Path)
		}
		seen[d.Path] = i
		if want := filepath.Join(dir, "c"+strconv.Itoa(i)+".img"); !isBound(t, d, want) {
			t.Errorf("%s bound to %q, want %s", d.Path, sysfs(t, d, "loop/backing_file"), want)
		}
	}
}

func TestSetCapacity(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "grow.img", 16*mib)
	d := mustAttach(t, img, Options{DirectIO: true})
	if size, err := d.Size(); err != nil || size != 16*mib {
		t.Fatalf("Size %d, %v; want %d", size, err, 16*mib)
	}
	if err := os.Truncate(img, 48*mib); err != nil {
		t.Fatal(err)
	}
	if err := d.SetCapacity(); err != nil {
		t.Fatal(err)
	}
	if size, err := d.Size(); err != nil || size != 48*mib {
		t.Fatalf("Size after SetCapacity %d, %v; want %d", size, err, 48*mib)
	}
}

// TestAttachErrors runs without root as far as it can: every check here
// fails before /dev/loop-control is opened.
func TestAttachErrors(t *testing.T) {
	dir := t.TempDir()
	img := sparseImage(t, dir, "e.img", mib)
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	cases := []struct {
		name string
		ctx  context.Context
		path string
		want error
	}{
		{"empty", t.Context(), "", errdefs.ErrInvalidArgument},
		{"missing", t.Context(), filepath.Join(dir, "missing.img"), errdefs.ErrNotFound},
		{"directory", t.Context(), dir, errdefs.ErrInvalidArgument},
		{"canceled", canceled, img, context.Canceled},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.want == context.Canceled {
				testenv.RequireRoot(t) // reaches /dev/loop-control
			}
			before := openFds(t)
			d, err := Attach(c.ctx, c.path, Options{DirectIO: true})
			if !errors.Is(err, c.want) {
				t.Fatalf("Attach: %v, %v; want %v", d, err, c.want)
			}
			if after := openFds(t); after != before {
				t.Fatalf("fds %d before, %d after a failed Attach", before, after)
			}
		})
	}
}

func TestAttachDetachNoFdLeak(t *testing.T) {
	testenv.RequireRoot(t)
	img := sparseImage(t, testDir(t), "fd.img", 4*mib)
	before := openFds(t)
	for range 3 {
		d, err := Attach(t.Context(), img, Options{Autoclear: true, DirectIO: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Detach(); err != nil {
			t.Fatal(err)
		}
	}
	if after := openFds(t); after != before {
		t.Fatalf("fds %d before, %d after attach/detach cycles", before, after)
	}
}
