package plan_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestNamespaceMatches(t *testing.T) {
	got := plan.Namespace{Inode: 4026531841, ID: 42}
	tests := []struct {
		name string
		want plan.Namespace
		ok   bool
	}{
		{"zero matches any", plan.Namespace{}, true},
		{"same", got, true},
		{"inode only", plan.Namespace{Inode: got.Inode}, true},
		{"id only", plan.Namespace{ID: got.ID}, true},
		{"other inode", plan.Namespace{Inode: got.Inode + 1}, false},
		// The inode of a dead namespace handed out again: the ID tells.
		{"same inode, other id", plan.Namespace{Inode: got.Inode, ID: got.ID + 1}, false},
		{"other inode, same id", plan.Namespace{Inode: got.Inode + 1, ID: got.ID}, false},
	}
	for _, tt := range tests {
		if ok := tt.want.Matches(got); ok != tt.ok {
			t.Errorf("%s: %+v.Matches(%+v) = %v, want %v", tt.name, tt.want, got, ok, tt.ok)
		}
	}
	// A namespace found on a kernel without NS_GET_MNTNS_ID has ID 0 and
	// cannot prove that it is one recorded with an ID.
	if (plan.Namespace{Inode: 1, ID: 7}).Matches(plan.Namespace{Inode: 1}) {
		t.Error("a recorded ID matched a namespace of unknown ID")
	}
}

// A consumer's subPath is a clean path below the volume's root, or none.
func TestConsumerSubPath(t *testing.T) {
	for _, sub := range []string{"", "app", "a/b/c", "..x", "a..b"} {
		if err := (plan.Consumer{MountPoint: "/data", SubPath: sub}).Validate(); err != nil {
			t.Errorf("subPath %q: %v", sub, err)
		}
	}
	for _, sub := range []string{"/etc", "..", "../x", "a/../../x", "a/", "./a", "a//b", ".", strings.Repeat("a/", 2049) + "a"} {
		if err := (plan.Consumer{MountPoint: "/data", SubPath: sub}).Validate(); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("subPath %.40q: %v, want InvalidArgument", sub, err)
		}
	}
}
