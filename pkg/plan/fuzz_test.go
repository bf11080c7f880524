package plan

import (
	"math"
	"reflect"
	"strings"
	"testing"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// FuzzPolicyValidate: a mount the policy accepts names no host path outside
// the roots (but a device node under /dev), carries nosuid and nodev (a
// device bind nosuid), holds no separator in an option, no path in an
// option but the path options, never errors=panic or source=, and comes
// back the same from its wire form.
func FuzzPolicyValidate(f *testing.F) {
	f.Add("ext4", "/dev/loop0", "", "nosuid\nnodev\nro")
	f.Add("bind", "/var/lib/mountplan/fuse/v/mnt", "sub", "nosuid\nnodev")
	f.Add("bind", "/dev/loop3", "", "nosuid")
	f.Add("overlay", "overlay", "", "nosuid\nnodev\nlowerdir=/var/lib/mountplan/a:/var/lib/mountplan/b\nupperdir=/var/lib/mountplan/u\nworkdir=/var/lib/mountplan/w")
	f.Add("overlay", "o", "", "nosuid\nnodev\nlowerdir=/dev/shm")
	f.Add("ext4", "/dev/sda", "../x", "nosuid\nnodev\nerrors=panic")
	f.Add("tmpfs", "t", "a/b", "nosuid\nnodev\nsize=1m\nsource=/etc")
	f.Add("bind", "/var/lib/mountplan/../../etc", "", "nosuid\nnodev")
	p := Policy{Roots: []string{"/var/lib/mountplan"}}
	f.Fuzz(func(t *testing.T, typ, source, target, opts string) {
		m := Mount{Type: typ, Source: source, Target: target, Options: strings.Split(opts, "\n")}
		if err := p.Validate([]Mount{m}); err != nil {
			return
		}
		underRoot := IsCleanAbs(source) && Within("/var/lib/mountplan", source)
		switch {
		case typ == TypeBind && !underRoot && !(IsCleanAbs(source) && strings.HasPrefix(source, "/dev/")):
			t.Fatalf("bind of %q accepted", source)
		case typ != TypeBind && typ != "overlay" && typ != "tmpfs" && !(IsCleanAbs(source) && strings.HasPrefix(source, "/dev/")):
			t.Fatalf("%s of %q accepted", typ, source)
		case ValidateTarget(target) != nil:
			t.Fatalf("target %q accepted", target)
		case !m.HasOption("nosuid") || (!m.IsDeviceBind() && !m.HasOption("nodev")):
			t.Fatalf("options %q accepted without nosuid,nodev", m.Options)
		}
		for _, o := range m.Options {
			key, val, _ := strings.Cut(o, "=")
			if label, ok, _ := ParseContext(o); ok {
				// The one option with commas: a quoted label, which
				// holds no quote, separator or '=' of its own.
				if o != ContextOption(label) && o != ContextKey+"="+label || strings.ContainsAny(label, "\"=\x00\n ") {
					t.Fatalf("context option %q accepted", o)
				}
				continue
			}
			if strings.ContainsAny(o, ",\x00\n") || key == "source" || key == "suid" || key == "dev" || o == "errors=panic" || o == "rec" {
				t.Fatalf("option %q accepted", o)
			}
			if !strings.Contains(val, "/") {
				continue
			}
			if !pathOptions[key] {
				t.Fatalf("path in option %q accepted", o)
			}
			for _, part := range strings.Split(val, ":") {
				if !IsCleanAbs(part) || !Within("/var/lib/mountplan", part) {
					t.Fatalf("option %q names %q outside the roots", o, part)
				}
			}
		}
		if back := FromProto(ToProto([]Mount{m})); !reflect.DeepEqual(back, []Mount{m}) {
			t.Fatalf("wire form changed %+v into %+v", m, back)
		}
	})
}

// FuzzConsumerFromProto: a consumer read from the wire is valid (a PID the
// kernel can have, a clean absolute mount point other than /) and goes
// back to the same wire form.
func FuzzConsumerFromProto(f *testing.F) {
	f.Add(int64(42), "/data", uint64(4026532000), uint64(7))
	f.Add(int64(0), "/", uint64(0), uint64(0))
	f.Add(int64(-1), "/data", uint64(1), uint64(0))
	f.Add(int64(math.MaxInt32)+1, "/a/../b", uint64(0), uint64(0))
	f.Fuzz(func(t *testing.T, pid int64, mp string, inode, id uint64) {
		in := &api.Consumer{Pid: pid, MountPoint: mp, MntNsInode: inode, MntNsId: id}
		c, err := ConsumerFromProto(in)
		if err != nil {
			return
		}
		if c.PID < 0 || int64(c.PID) != pid || !IsCleanAbs(c.MountPoint) || c.MountPoint == "/" {
			t.Fatalf("accepted %+v as %+v", in, c)
		}
		out := ConsumerToProto(c)
		if out.GetPid() != pid || out.GetMountPoint() != mp || out.GetMntNsInode() != inode || out.GetMntNsId() != id {
			t.Fatalf("%+v came back as %+v", in, out)
		}
	})
}
