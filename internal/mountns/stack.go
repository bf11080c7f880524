package mountns

import (
	"slices"

	"github.com/moby/sys/mountinfo"
)

// Top returns the mount of stack (the mounts at one mount point) that no
// other mount of the stack sits on: the one path lookups reach. Nil when
// the stack is empty.
func Top(stack []*mountinfo.Info) *mountinfo.Info {
	for _, i := range stack {
		if !slices.ContainsFunc(stack, func(j *mountinfo.Info) bool { return j.Parent == i.ID }) {
			return i
		}
	}
	return nil
}
