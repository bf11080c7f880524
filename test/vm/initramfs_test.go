//go:build vmtest

package vm

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// archive is an initramfs under construction: paths to entries.
type archive struct {
	entries map[string]entry
}

type entry struct {
	mode uint32 // file type and permissions
	data []byte // file content, or a symlink's target
}

const (
	typeDir     = 0o040000
	typeFile    = 0o100000
	typeSymlink = 0o120000
)

func newArchive() *archive { return &archive{entries: map[string]entry{}} }

func (a *archive) dir(p string) {
	for p = filepath.Clean(p); p != "/" && p != "."; p = filepath.Dir(p) {
		if _, ok := a.entries[p]; !ok {
			a.entries[p] = entry{mode: typeDir | 0o755}
		}
	}
}

func (a *archive) file(p string, data []byte, perm uint32) {
	a.dir(filepath.Dir(p))
	a.entries[filepath.Clean(p)] = entry{mode: typeFile | perm, data: data}
}

func (a *archive) symlink(p, target string) {
	a.dir(filepath.Dir(p))
	a.entries[filepath.Clean(p)] = entry{mode: typeSymlink | 0o777, data: []byte(target)}
}

// copyFile puts the host file src (symlinks followed) at dst.
func (a *archive) copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(src)
	if err != nil {
		t.Fatal(err)
	}
	a.file(dst, b, uint32(fi.Mode().Perm()))
}

// binary adds a host program, at its real path, with the libraries ldd
// names for it.
func (a *archive) binary(t *testing.T, path string) {
	t.Helper()
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		t.Fatalf("%s: %v (hack/install-deps.sh installs what the VM test needs)", path, err)
	}
	a.copyFile(t, real, real)
	a.libraries(t, real)
}

func (a *archive) libraries(t *testing.T, path string) {
	t.Helper()
	out, err := exec.Command("ldd", path).CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("not a dynamic executable")) {
			return
		}
		t.Fatalf("ldd %s: %v: %s", path, err, out)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		var lib string
		switch {
		case len(fields) >= 3 && fields[1] == "=>" && strings.HasPrefix(fields[2], "/"):
			lib = fields[2]
		case len(fields) >= 1 && strings.HasPrefix(fields[0], "/"):
			lib = fields[0]
		default:
			continue
		}
		if _, ok := a.entries[lib]; !ok {
			a.copyFile(t, lib, lib)
		}
	}
}

// modules adds the modules (with their dependencies, soft ones included,
// in load order) that the kernel needs for names, and returns the guest
// paths in the order to insmod them.
func (a *archive) modules(t *testing.T, k kernel, names ...string) []string {
	t.Helper()
	var order []string
	for _, n := range names {
		out := run(t, "", "modprobe", "-d", k.Root, "-S", k.Version, "--show-depends", n)
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) < 2 || f[0] != "insmod" {
				continue // builtin
			}
			guest := "/modules/" + filepath.Base(f[1])
			if slices.Contains(order, guest) {
				continue
			}
			data, err := os.ReadFile(f[1])
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasSuffix(f[1], ".xz") || strings.HasSuffix(f[1], ".zst") {
				t.Fatalf("compressed module %s: not handled (this kernel's package ships them uncompressed)", f[1])
			}
			a.file(guest, data, 0o644)
			order = append(order, guest)
		}
	}
	return order
}

// write writes the archive in the "newc" cpio format the kernel unpacks,
// directories first so that every parent exists before its children.
func (a *archive) write(path string) (int, error) {
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	slices.SortFunc(names, func(x, y string) int {
		dx, dy := a.entries[x].mode&0o170000 == typeDir, a.entries[y].mode&0o170000 == typeDir
		if dx != dy {
			if dx {
				return -1
			}
			return 1
		}
		return strings.Compare(x, y)
	})
	var b bytes.Buffer
	pad := func() {
		for b.Len()%4 != 0 {
			b.WriteByte(0)
		}
	}
	record := func(ino int, name string, e entry) {
		nlink := 1
		if e.mode&0o170000 == typeDir {
			nlink = 2
		}
		fmt.Fprintf(&b, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
			ino, e.mode, 0, 0, nlink, 0, len(e.data), 0, 0, 0, 0, len(name)+1, 0)
		b.WriteString(name)
		b.WriteByte(0)
		pad()
		b.Write(e.data)
		pad()
	}
	for i, n := range names {
		record(i+1, strings.TrimPrefix(n, "/"), a.entries[n])
	}
	record(0, "TRAILER!!!", entry{})
	return b.Len(), os.WriteFile(path, b.Bytes(), 0o644)
}
