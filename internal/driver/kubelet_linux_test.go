package driver

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestMakeTarget checks what makeTarget makes below kubelet's directory
// through one Root: missing parents and the target, reporting whether it
// made the target, and refusals (InvalidArgument, nothing made outside)
// for a parent that is a file or a symlink and a target of the wrong kind.
// No privileges needed.
func TestMakeTarget(t *testing.T) {
	base := t.TempDir()
	kdir := filepath.Join(base, "kubelet")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{kdir, outside} {
		if err := os.Mkdir(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(kdir, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(kdir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(kdir, "dir"), 0o750); err != nil {
		t.Fatal(err)
	}
	k, err := newKubeletDir(kdir)
	if err != nil {
		t.Fatal(err)
	}
	rows := []struct {
		name        string
		target      string
		block       bool
		wantCreated bool
		wantErr     error
		wantMode    os.FileMode // of the target afterwards, when no error
	}{
		{"missing parents and directory", "pods/u/volumes/v/mount", false, true, nil, os.ModeDir},
		{"the same again", "pods/u/volumes/v/mount", false, false, nil, os.ModeDir},
		{"block target: an empty file", "pods/u/volumes/b/dev", true, true, nil, 0},
		{"an existing directory", "dir", false, false, nil, os.ModeDir},
		{"a parent that is a file", "file/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"a parent that is a symlink", "link/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"a symlink in the parents", "link/a/mount", false, false, errdefs.ErrInvalidArgument, 0},
		{"the target a symlink", "link", false, false, errdefs.ErrInvalidArgument, 0},
		{"a file where a directory is wanted", "file", false, false, errdefs.ErrInvalidArgument, 0},
		{"a directory where a file is wanted", "dir", true, false, errdefs.ErrInvalidArgument, 0},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			p := filepath.Join(kdir, r.target)
			created, err := k.makeTarget(p, r.block)
			if r.wantErr != nil {
				if !errors.Is(err, r.wantErr) || created {
					t.Fatalf("makeTarget(%s) = %t, %v; want %v", r.target, created, err, r.wantErr)
				}
				return
			}
			if err != nil || created != r.wantCreated {
				t.Fatalf("makeTarget(%s) = %t, %v; want %t", r.target, created, err, r.wantCreated)
			}
			fi, err := os.Lstat(p)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Type() != r.wantMode {
				t.Fatalf("%s is %v, want type %v", r.target, fi.Mode().Type(), r.wantMode)
			}
		})
	}
	if ents, err := os.ReadDir(outside); err != nil || len(ents) != 0 {
		t.Fatalf("something was made outside the kubelet dir: %v %v", ents, err)
	}
}
