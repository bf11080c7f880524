//go:build linux

package mountns

import (
	"errors"
	"os"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestParseOptions(t *testing.T) {
	tests := []struct {
		name    string
		m       plan.Mount
		attr    uint64
		sb      []string
		data    []string
		wantErr error
	}{
		{name: "block ro on a writable device stays per mount", m: plan.Mount{Type: "ext4", Source: "/dev/null-not-a-disk", Options: []string{"ro", "nosuid", "nodev", "noexec", "errors=remount-ro"}},
			attr: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC,
			data: []string{"errors=remount-ro"}},
		{name: "tmpfs ro keeps a writable superblock", m: plan.Mount{Type: "tmpfs", Source: "t", Options: []string{"ro", "size=1m", "noswap"}},
			attr: unix.MOUNT_ATTR_RDONLY, data: []string{"size=1m", "noswap"}},
		{name: "last atime mode wins", m: plan.Mount{Type: "xfs", Source: "/dev/sda", Options: []string{"noatime", "nodiratime", "strictatime"}},
			attr: unix.MOUNT_ATTR_STRICTATIME | unix.MOUNT_ATTR_NODIRATIME},
		{name: "superblock flags", m: plan.Mount{Type: "ext4", Source: "/dev/sda", Options: []string{"sync", "lazytime", "rw", "async"}},
			sb: []string{"sync", "lazytime"}},
		{name: "recursive bind (F3: it would carry mounts nobody checked)", m: plan.Mount{Type: plan.TypeBind, Source: "/a", Options: []string{"rec", "ro", "nosymfollow"}},
			wantErr: errdefs.ErrInvalidArgument},
		{name: "bind with sync", m: plan.Mount{Type: plan.TypeBind, Source: "/a", Options: []string{"sync"}}, wantErr: errdefs.ErrInvalidArgument},
		{name: "bind with data", m: plan.Mount{Type: plan.TypeBind, Source: "/a", Options: []string{"size=1"}}, wantErr: errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parseOptions(tt.m)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if o.attr != tt.attr || !slices.Equal(o.sbFlags, tt.sb) || !slices.Equal(o.data, tt.data) {
				t.Fatalf("got attr=%#x sb=%v data=%v, want attr=%#x sb=%v data=%v",
					o.attr, o.sbFlags, o.data, tt.attr, tt.sb, tt.data)
			}
		})
	}
}

func TestSecretsMaskedInKernelMessages(t *testing.T) {
	m := plan.Mount{Options: []string{"password=hunter22", "lowerdir=/var/lib/x", "uid=0"}}
	got := secretsOf(m)
	if !slices.Equal(got, []string{"hunter22"}) {
		t.Fatalf("secretsOf = %v, want [hunter22]", got)
	}
}

func TestClassify(t *testing.T) {
	err := Classify(&os.PathError{Op: "mkdir", Path: "/x", Err: unix.EROFS})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !errors.Is(err, unix.EROFS) || err.Error() != "mkdir /x: read-only file system" {
		t.Fatalf("Classify = %v", err)
	}
	plain := errors.New("boom")
	if Classify(plain) != plain {
		t.Fatal("an error without errno must pass unchanged")
	}
}
