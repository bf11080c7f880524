package fsutil

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/toolrun"
)

// call is one scripted tool run: what it prints and how it exits.
type call struct {
	out  string
	code int // 0: success
	err  error
}

// fakeTools returns tools whose runs follow script and a pointer to the
// command lines they were given.
func fakeTools(t *testing.T, script ...call) (tools, *[][]string) {
	t.Helper()
	var got [][]string
	run := func(_ context.Context, name string, args []string) ([]byte, int, error) {
		got = append(got, append([]string{name}, args...))
		if len(got) > len(script) {
			t.Errorf("tool run %d %q was not scripted", len(got), got[len(got)-1])
			return nil, 0, nil
		}
		c := script[len(got)-1]
		return []byte(c.out), c.code, c.err
	}
	t.Cleanup(func() {
		if len(got) != len(script) {
			t.Errorf("%d tool runs, %d scripted", len(got), len(script))
		}
	})
	return tools{runner: toolrun.Runner{Exec: run}}, &got
}

func existingFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "dev.img")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDetectExitCodes(t *testing.T) {
	cases := []struct {
		name    string
		run     call
		want    string
		wantErr error
	}{
		{"ext4", call{out: "DEVNAME=x\nUUID=1-2\nTYPE=ext4\nUSAGE=filesystem\n"}, "ext4", nil},
		{"luks", call{out: "TYPE=crypto_LUKS\nUSAGE=crypto\n"}, "crypto_LUKS", nil},
		{"partition-table", call{out: "DEVNAME=x\nPTUUID=ab\nPTTYPE=gpt\n"}, "gpt", nil},
		{"nothing", call{code: 2}, "", nil},
		{"ambivalent", call{out: "ambivalent result", code: 8}, "", errdefs.ErrFailedPrecondition},
		{"no-blkid", call{err: exec.ErrNotFound}, "", errdefs.ErrFailedPrecondition},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tl, _ := fakeTools(t, c.run)
			got, err := tl.detect(t.Context(), existingFile(t))
			if got != c.want || !errors.Is(err, c.wantErr) {
				t.Fatalf("detect: %q, %v; want %q, %v", got, err, c.want, c.wantErr)
			}
		})
	}
	t.Run("usage-error", func(t *testing.T) {
		tl, _ := fakeTools(t, call{out: "bad usage", code: 4})
		if got, err := tl.detect(t.Context(), existingFile(t)); err == nil || exitCode(err) != 4 {
			t.Fatalf("detect: %q, %v; want the exit-4 error", got, err)
		}
	})
}

// TestPathChecksRunNoTool: a missing path must not reach blkid, which would
// answer "nothing found" (exit 2) and invite a format.
func TestPathChecksRunNoTool(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	tl, _ := fakeTools(t)
	for _, c := range []struct {
		path string
		want error
	}{{missing, errdefs.ErrNotFound}, {dir, errdefs.ErrInvalidArgument}, {"", errdefs.ErrInvalidArgument}} {
		if _, err := tl.detect(t.Context(), c.path); !errors.Is(err, c.want) {
			t.Errorf("detect(%q): %v, want %v", c.path, err, c.want)
		}
		if err := tl.format(t.Context(), c.path, Ext4, nil); !errors.Is(err, c.want) {
			t.Errorf("format(%q): %v, want %v", c.path, err, c.want)
		}
		if err := tl.resize(t.Context(), c.path, Ext4, ""); !errors.Is(err, c.want) {
			t.Errorf("resize(%q): %v, want %v", c.path, err, c.want)
		}
	}
}

func TestFormatCommandLines(t *testing.T) {
	dev := existingFile(t)
	tl, got := fakeTools(t, call{}, call{})
	if err := tl.format(t.Context(), dev, Ext4, []string{"-L", "vol"}); err != nil {
		t.Fatal(err)
	}
	if err := tl.format(t.Context(), dev, XFS, nil); err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"mkfs.ext4", "-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1", "-L", "vol", dev},
		{"mkfs.xfs", "-f", "-q", dev},
	}
	if !slices.EqualFunc(*got, want, slices.Equal) {
		t.Fatalf("ran %q, want %q", *got, want)
	}
}

func TestFormatNewFileCommandLines(t *testing.T) {
	f := existingFile(t)
	tl, got := fakeTools(t, call{}, call{})
	if err := tl.formatNewFile(t.Context(), f, Ext4); err != nil {
		t.Fatal(err)
	}
	if err := tl.formatNewFile(t.Context(), f, XFS); err != nil {
		t.Fatal(err)
	}
	// The second -F is what lets mkfs.ext4 go on with a target that
	// EXT2FS_PRETEND_RW_MOUNT says is mounted.
	want := [][]string{
		{"mkfs.ext4", "-F", "-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1", f},
		{"mkfs.xfs", "-f", "-q", f},
	}
	if !slices.EqualFunc(*got, want, slices.Equal) {
		t.Fatalf("ran %q, want %q", *got, want)
	}
	if !slices.Contains(mkfsExt4New.Env, "EXT2FS_PRETEND_RW_MOUNT=1") {
		t.Fatalf("mkfs.ext4 of a new file runs with %q, not EXT2FS_PRETEND_RW_MOUNT=1", mkfsExt4New.Env)
	}
}

func TestFormatNewFileRejectsAllButRegularFiles(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(existingFile(t), link); err != nil {
		t.Fatal(err)
	}
	tl, got := fakeTools(t)
	for _, p := range []string{dir, link, "/dev/null"} {
		if err := tl.formatNewFile(t.Context(), p, Ext4); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("formatNewFile(%s): %v, want InvalidArgument", p, err)
		}
	}
	if len(*got) != 0 {
		t.Fatalf("ran %q on what is no regular file", *got)
	}
}

func TestFormatRejects(t *testing.T) {
	tl, _ := fakeTools(t)
	for _, fs := range []string{"", "btrfs", "EXT4", "ext4 ", "vfat"} {
		if err := tl.format(t.Context(), existingFile(t), fs, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("format %q: %v, want ErrInvalidArgument", fs, err)
		}
	}
	if err := tl.resize(t.Context(), existingFile(t), "btrfs", "/mnt"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("resize btrfs: %v, want ErrInvalidArgument", err)
	}
	if err := tl.resize(t.Context(), existingFile(t), XFS, ""); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("resize xfs unmounted: %v, want ErrFailedPrecondition", err)
	}
}

// TestToolErrors: the output reaches the error, bounded; the arguments
// (which may come from configuration) do not.
func TestToolErrors(t *testing.T) {
	const canary = "canary-s3cr3t"
	long := "mkfs.xfs: Filesystem must be larger than 300MB.\n" + strings.Repeat("usage line\n", 500)
	tl, _ := fakeTools(t, call{out: long, code: 1})
	dev := existingFile(t)
	err := tl.format(t.Context(), dev, XFS, []string{"-L", canary})
	if err == nil || exitCode(err) != 1 {
		t.Fatalf("format: %v, want exit status 1", err)
	}
	msg := err.Error()
	if strings.Contains(msg, canary) {
		t.Errorf("error reveals an argument: %q", msg)
	}
	if !strings.Contains(msg, "larger than 300MB") || !strings.Contains(msg, dev) {
		t.Errorf("error lacks the tool's diagnostic or the device: %q", msg)
	}
	if len(msg) > toolrun.MaxOutput+len(dev)+200 {
		t.Errorf("error of %d bytes, output not bounded", len(msg))
	}
}

func TestResizeCommandLines(t *testing.T) {
	dev := existingFile(t)
	tl, got := fakeTools(t, call{}, call{})
	if err := tl.resize(t.Context(), dev, Ext4, ""); err != nil {
		t.Fatal(err)
	}
	if err := tl.resize(t.Context(), dev, XFS, "/mnt/vol"); err != nil {
		t.Fatal(err)
	}
	want := [][]string{{"resize2fs", dev}, {"xfs_growfs", "/mnt/vol"}}
	if !slices.EqualFunc(*got, want, slices.Equal) {
		t.Fatalf("ran %q, want %q", *got, want)
	}
}

func TestCanceledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := Detect(ctx, existingFile(t)); !errors.Is(err, context.Canceled) {
		t.Fatalf("Detect with a canceled context: %v", err)
	}
}

func TestSupportedFsTypes(t *testing.T) {
	got := SupportedFsTypes()
	got[0] = "changed" // callers own the slice
	if !slices.Equal(SupportedFsTypes(), []string{"ext4", "xfs"}) {
		t.Fatalf("SupportedFsTypes %v", SupportedFsTypes())
	}
}

func TestStats(t *testing.T) {
	u, err := Stats(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if u.TotalBytes <= 0 || u.AvailableBytes < 0 || u.UsedBytes < 0 ||
		u.UsedBytes+u.AvailableBytes > u.TotalBytes {
		t.Errorf("bytes %+v", u)
	}
	if u.TotalInodes > 0 && u.UsedInodes+u.FreeInodes != u.TotalInodes {
		t.Errorf("inodes %+v", u)
	}
	if _, err := Stats(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stats(missing): %v, want ErrNotFound", err)
	}
}
