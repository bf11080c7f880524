package daemon

import (
	"fmt"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"golang.org/x/sys/unix"
)

// deniedSyscalls are the system calls an fd-mode daemon never needs and
// an exploit of it would reach for: it serves a FUSE descriptor it was
// handed, as a user without a capability, in namespaces of its own. Most
// already need a capability it lacks; the filter keeps them out of reach
// of a kernel bug as well (user namespaces and io_uring above all, where
// most unprivileged kernel exploits of the last years start). Each
// answers EPERM, as for a caller without the privilege.
var deniedSyscalls = []string{
	// New mounts and namespaces.
	"mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
	"unshare", "setns",
	// Keys, BPF, other processes' memory, modules, kexec, the machine.
	"keyctl", "add_key", "request_key", "bpf", "ptrace", "process_vm_readv", "process_vm_writev",
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct",
	// Exploit helpers.
	"perf_event_open", "userfaultfd", "io_uring_setup", "open_by_handle_at",
}

// newNamespaceFlags are clone's flags that make namespaces: a clone with
// any of them is refused as unshare is.
var newNamespaceFlags = []uint64{unix.CLONE_NEWUSER, unix.CLONE_NEWNS, unix.CLONE_NEWPID, unix.CLONE_NEWNET,
	unix.CLONE_NEWIPC, unix.CLONE_NEWUTS, unix.CLONE_NEWCGROUP}

// daemonPolicy is the seccomp policy of an fd-mode daemon: everything is
// allowed but deniedSyscalls and a clone that makes a namespace. clone3
// answers ENOSYS: its flags are in memory a filter cannot read, and libc
// then falls back to clone, whose flags it can (an EPERM would fail every
// thread the daemon starts).
func daemonPolicy() seccomp.Policy {
	var clone []seccomp.NameWithConditions
	for _, f := range newNamespaceFlags {
		clone = append(clone, seccomp.NameWithConditions{Name: "clone",
			Conditions: seccomp.ArgumentConditions{{Argument: 0, Operation: seccomp.BitsSet, Value: f}}})
	}
	return seccomp.Policy{
		DefaultAction: seccomp.ActionAllow,
		Syscalls: []seccomp.SyscallGroup{
			{Action: seccomp.ActionErrno, Names: deniedSyscalls, NamesWithCondtions: clone},
			{Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS), Names: []string{"clone3"}},
		},
	}
}

// loadDaemonFilter installs the daemon's seccomp filter on the calling
// thread, which then execs the daemon: the filter is inherited and kept
// across execve. no_new_privs, which an unprivileged filter needs, is set
// by then (restrictThread).
func loadDaemonFilter() error {
	if err := seccomp.LoadFilter(seccomp.Filter{NoNewPrivs: true, Policy: daemonPolicy()}); err != nil {
		return fmt.Errorf("the daemon's seccomp filter: %w", err)
	}
	return nil
}
