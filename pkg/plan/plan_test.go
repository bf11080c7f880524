package plan

import (
	"errors"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestPolicyValidate(t *testing.T) {
	// overlay is no default type (no plan of mountplan's has one): an
	// admin's types may still name it, and its path options are checked.
	p := Policy{Roots: []string{"/var/lib/mountplan"}, Types: append([]string{"overlay"}, DefaultTypes...)}
	safe := []string{"nosuid", "nodev"}
	tests := []struct {
		name   string
		mounts []Mount
		ok     bool
	}{
		{"ext4 device", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: safe}}, true},
		{"ext4 with data option", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid", "nodev", "ro", "discard"}}}, true},
		{"overlay under root", []Mount{{Type: "overlay", Source: "overlay", Options: []string{"nosuid", "nodev",
			"lowerdir=/var/lib/mountplan/l1:/var/lib/mountplan/l2", "upperdir=/var/lib/mountplan/u", "workdir=/var/lib/mountplan/w"}}}, true},
		{"device bind without nodev", []Mount{{Type: TypeBind, Source: "/dev/loop3", Options: []string{"nosuid"}}}, true},
		{"bind under root", []Mount{{Type: TypeBind, Source: "/var/lib/mountplan/fuse/v1", Options: safe}}, true},
		{"two targets", []Mount{{Type: "tmpfs", Source: "tmpfs", Options: safe}, {Type: "tmpfs", Source: "tmpfs", Target: "sub/dir", Options: safe}}, true},

		{"empty plan", nil, false},
		{"unknown type", []Mount{{Type: "nfs", Source: "/dev/x", Options: safe}}, false},
		{"missing nodev", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid"}}}, false},
		{"device bind without nosuid", []Mount{{Type: TypeBind, Source: "/dev/loop3"}}, false},
		{"suid option", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid", "nodev", "suid"}}}, false},
		{"fs source outside /dev", []Mount{{Type: "ext4", Source: "/etc/passwd", Options: safe}}, false},
		{"fs source with dotdot", []Mount{{Type: "ext4", Source: "/dev/../etc/x", Options: safe}}, false},
		{"bind outside roots", []Mount{{Type: TypeBind, Source: "/etc", Options: safe}}, false},
		{"bind sibling prefix", []Mount{{Type: TypeBind, Source: "/var/lib/mountplan-evil", Options: safe}}, false},
		{"lowerdir outside roots", []Mount{{Type: "overlay", Source: "overlay", Options: []string{"nosuid", "nodev", "lowerdir=/var/lib/mountplan/l:/etc"}}}, false},
		{"path in other option", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid", "nodev", "journal_path=/etc/x"}}}, false},
		{"comma smuggling", []Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid,nodev"}}}, false},
		{"source option", []Mount{{Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "source=x"}}}, false},
		{"absolute target", []Mount{{Type: "tmpfs", Source: "tmpfs", Target: "/etc", Options: safe}}, false},
		{"dotdot target", []Mount{{Type: "tmpfs", Source: "tmpfs", Target: "a/../../etc", Options: safe}}, false},
		{"unclean target", []Mount{{Type: "tmpfs", Source: "tmpfs", Target: "a//b", Options: safe}}, false},
		{"duplicate targets", []Mount{{Type: "tmpfs", Source: "tmpfs", Options: safe}, {Type: "tmpfs", Source: "tmpfs", Options: safe}}, false},
		{"bind with a data option", []Mount{{Type: TypeBind, Source: "/var/lib/mountplan/fuse/v1", Options: []string{"nosuid", "nodev", "uid=0"}}}, false},
		{"overlay source is a path", []Mount{{Type: "overlay", Source: "/x", Options: safe}}, false},
		// F3: a recursive bind takes along mounts below its source that
		// nobody checked (another volume's secrets, a host directory).
		{"recursive bind", []Mount{{Type: TypeBind, Source: "/var/lib/mountplan/p", Options: []string{"nosuid", "nodev", "rec"}}}, false},
		// F16: options that have the kernel open a device beside the
		// checked source (an ext4 journal by device number has no "/").
		{"ext4 external journal by number", []Mount{{Type: "ext4", Source: "/dev/loop0", Options: []string{"nosuid", "nodev", "journal_dev=2049"}}}, false},
		{"ext4 external journal by path", []Mount{{Type: "ext4", Source: "/dev/loop0", Options: []string{"nosuid", "nodev", "journal_path=/dev/sda1"}}}, false},
		{"xfs log device", []Mount{{Type: "xfs", Source: "/dev/loop0", Options: []string{"nosuid", "nodev", "logdev=/dev/sda1"}}}, false},
		{"btrfs member device", []Mount{{Type: "btrfs", Source: "/dev/loop0", Options: []string{"nosuid", "nodev", "device=/dev/sda1"}}}, false},
	}
	if err := (Policy{Roots: p.Roots}).Validate([]Mount{{Type: "overlay", Source: "o", Options: safe}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("overlay with the default types = %v, want InvalidArgument", err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := p.Validate(tt.mounts)
			if tt.ok && err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if !tt.ok && !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("Validate = %v, want ErrInvalidArgument", err)
			}
		})
	}
}

func TestPolicyNarrowsTypesAndAllowsSuid(t *testing.T) {
	p := Policy{Types: []string{"ext4"}, AllowSuidDev: true}
	if err := p.Validate([]Mount{{Type: "ext4", Source: "/dev/loop0"}}); err != nil {
		t.Fatalf("suid/dev allowed by policy, got %v", err)
	}
	if err := p.Validate([]Mount{{Type: "xfs", Source: "/dev/loop0"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("xfs outside narrowed types: %v", err)
	}
}

func TestProtoRoundTrip(t *testing.T) {
	in := []Mount{{Type: "ext4", Source: "/dev/loop1", Target: "a", Options: []string{"nosuid", "nodev"}}, {Type: TypeBind, Source: "/dev/loop2", Options: []string{"nosuid"}}}
	out := FromProto(ToProto(in))
	if len(out) != 2 || out[0].Target != "a" || out[1].Options[0] != "nosuid" || out[0].Options[1] != "nodev" {
		t.Fatalf("round trip: %+v", out)
	}
	pm := ToProto(in)
	pm[0].Options[0] = "changed"
	if in[0].Options[0] != "nosuid" {
		t.Fatal("ToProto shares option slices with its input")
	}
}

func FuzzValidateTarget(f *testing.F) {
	for _, s := range []string{"", "a", "a/b", "../x", "/abs", "a/./b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if ValidateTarget(s) != nil {
			return
		}
		if s == "" {
			return
		}
		// Anything accepted stays under the mount point once joined, and
		// has no empty, "." or ".." element ("..0" is a name like any).
		if !Within("/mnt/point", path.Join("/mnt/point", s)) || strings.ContainsRune(s, 0) {
			t.Fatalf("accepted target %q escapes", s)
		}
		for _, part := range strings.Split(s, "/") {
			if part == "" || part == "." || part == ".." {
				t.Fatalf("accepted %q with element %q", s, part)
			}
		}
	})
}

func TestResolveUnder(t *testing.T) {
	dir := t.TempDir()
	root, outside := filepath.Join(dir, "root"), filepath.Join(dir, "outside")
	for _, d := range []string{root, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	inFile, outFile := filepath.Join(root, "f"), filepath.Join(outside, "f")
	for _, f := range []string{inFile, outFile} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	escape := filepath.Join(root, "escape")
	if err := os.Symlink(outFile, escape); err != nil {
		t.Fatal(err)
	}
	roots := []string{root, filepath.Join(dir, "missing-root")}
	if got, in, err := ResolveUnder(inFile, roots); err != nil || !in || got != inFile {
		t.Errorf("file under the root: %q %v %v", got, in, err)
	}
	if _, in, err := ResolveUnder(escape, roots); err != nil || in {
		t.Errorf("symlink out of the root counted as inside: %v %v", in, err)
	}
	if _, in, err := ResolveUnder(root, roots); err != nil || in {
		t.Errorf("the root itself counted as inside: %v %v", in, err)
	}
	if _, _, err := ResolveUnder(filepath.Join(root, "nope"), roots); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing path: %v, want ErrNotFound", err)
	}
}
