//go:build vmtest

package vm

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// kernel is Debian's kernel package unpacked in the cache.
type kernel struct {
	Package string // linux-image-6.1.0-NN-amd64
	Version string // 6.1.0-NN-amd64
	Root    string // the unpacked package (lib/modules/VERSION, boot/)
	Vmlinux string // the uncompressed kernel, for qemu's PVH entry
}

// cacheDir holds downloaded and unpacked kernels across runs.
func cacheDir() string {
	if d := os.Getenv("MOUNTPLAN_VM_CACHE"); d != "" {
		return d
	}
	return "/var/cache/mountplan-vm"
}

func run(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// resolveKernelPackage asks apt which versioned package linux-image-amd64
// depends on, updating the package lists once if apt knows nothing yet.
func resolveKernelPackage(t *testing.T) string {
	t.Helper()
	for attempt := 0; attempt < 2; attempt++ {
		out, _ := exec.Command("apt-cache", "depends", "linux-image-amd64").CombinedOutput()
		for _, line := range strings.Split(string(out), "\n") {
			if dep, ok := strings.CutPrefix(strings.TrimSpace(line), "Depends: "); ok && strings.HasPrefix(dep, "linux-image-") {
				return dep
			}
		}
		if attempt == 0 {
			run(t, "", "apt-get", "update", "-qq")
		}
	}
	t.Fatal("apt-cache depends linux-image-amd64 names no linux-image-* package")
	return ""
}

// fetchKernel downloads (apt-get download, never install) and unpacks the
// kernel package into the cache, with depmod run over its modules and the
// vmlinux extracted. A complete cache entry is reused as is.
func fetchKernel(t *testing.T, timings *timings) kernel {
	t.Helper()
	pkg := resolveKernelPackage(t)
	k := kernel{Package: pkg, Version: strings.TrimPrefix(pkg, "linux-image-")}
	dir := filepath.Join(cacheDir(), pkg)
	k.Root, k.Vmlinux = filepath.Join(dir, "root"), filepath.Join(dir, "vmlinux")
	ready := filepath.Join(dir, "ready")
	if _, err := os.Stat(ready); err == nil {
		timings.add("kernel package (cached)", 0)
		return k
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	debs, _ := filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
	if len(debs) == 0 {
		stop := timings.start("download " + pkg)
		if out, err := exec.Command("sh", "-c", "cd \"$1\" && apt-get download -q \"$2\"", "sh", dir, pkg).CombinedOutput(); err != nil {
			t.Logf("apt-get download %s: %v: %s; updating the package lists and trying again", pkg, err, out)
			run(t, "", "apt-get", "update", "-qq")
			run(t, dir, "apt-get", "download", "-q", pkg)
		}
		stop()
		debs, _ = filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
		if len(debs) == 0 {
			t.Fatalf("apt-get download %s left no .deb in %s", pkg, dir)
		}
	}
	stop := timings.start("unpack, depmod, extract vmlinux")
	_ = os.RemoveAll(k.Root)
	run(t, dir, "dpkg-deb", "-x", debs[0], k.Root)
	run(t, dir, "depmod", "-b", k.Root, k.Version)
	if err := extractVmlinux(filepath.Join(k.Root, "boot", "vmlinuz-"+k.Version), k.Vmlinux); err != nil {
		t.Fatal(err)
	}
	stop()
	if err := os.WriteFile(ready, []byte(pkg+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return k
}

// extractVmlinux takes the compressed kernel out of a bzImage, using the
// payload offset and length of its setup header (Documentation/x86/boot).
func extractVmlinux(bzImage, out string) error {
	b, err := os.ReadFile(bzImage)
	if err != nil {
		return err
	}
	if len(b) < 0x250 || string(b[0x202:0x206]) != "HdrS" {
		return fmt.Errorf("%s is not a bzImage", bzImage)
	}
	setupSects := int(b[0x1f1])
	if setupSects == 0 {
		setupSects = 4
	}
	start := (setupSects+1)*512 + int(binary.LittleEndian.Uint32(b[0x248:]))
	length := int(binary.LittleEndian.Uint32(b[0x24c:]))
	if start+length > len(b) {
		return fmt.Errorf("%s: payload outside the file", bzImage)
	}
	payload := b[start : start+length]
	var r io.Reader
	switch {
	case bytes.HasPrefix(payload, []byte{0x1f, 0x8b}):
		if r, err = gzip.NewReader(bytes.NewReader(payload)); err != nil {
			return err
		}
	case bytes.HasPrefix(payload, []byte("\xfd7zXZ\x00")):
		r = decompressWith(payload, "xz", "-dc", "--single-stream")
	case bytes.HasPrefix(payload, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		r = decompressWith(payload, "zstd", "-dcq")
	default:
		return fmt.Errorf("%s: unknown payload compression % x", bzImage, payload[:6])
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("decompressing %s: %w", bzImage, err)
	}
	if !bytes.HasPrefix(data, []byte("\x7fELF")) {
		return fmt.Errorf("%s: the payload is not an ELF kernel", bzImage)
	}
	return os.WriteFile(out, data, 0o644)
}

func decompressWith(data []byte, tool string, args ...string) io.Reader {
	cmd := exec.Command(tool, args...)
	cmd.Stdin = bytes.NewReader(data)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return errReader{fmt.Errorf("%s: %v: %s", tool, err, stderr.String())}
	}
	return bytes.NewReader(out)
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }
