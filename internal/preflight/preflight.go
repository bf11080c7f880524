// Package preflight checks once, at the start of the plugin and the
// mounter, what the node offers them: kernel calls and versions, modules,
// device nodes, cgroup v2 and the tools the mounter runs. Each missing
// feature is logged once with what it disables, so that an operator reads
// it at start instead of in the first failed volume's error; only what
// nothing can work without (the new mount API, openat2) stops a process
// that mounts.
package preflight

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fuseprofile"
)

// System answers the probes. Real reads the running kernel and this
// process's view; tests give a fake one.
type System interface {
	// HasSyscall reports whether the kernel has the call (one of the
	// Syscall* names): a refusal for want of privilege counts as having it.
	HasSyscall(name string) bool
	// Exists reports whether path exists in this process's view.
	Exists(path string) bool
	// NetlinkFamily reports whether the kernel has the generic netlink family.
	NetlinkFamily(name string) bool
	// HasProgram reports whether the program is found in $PATH (or at its absolute path).
	HasProgram(name string) bool
	// Kernel is the running kernel's release (uname -r).
	Kernel() string
	// Cgroup2 reports whether /sys/fs/cgroup is a cgroup v2 hierarchy.
	Cgroup2() bool
}

// The system calls HasSyscall probes.
const (
	SyscallFsopen       = "fsopen"
	SyscallMountSetattr = "mount_setattr"
	SyscallOpenat2      = "openat2"
)

// Scope says in which process a check means something.
type Scope int

const (
	// Kernel checks answer the same in any process on the node (the
	// unprivileged plugin too): system calls, versions, loaded modules.
	Kernel Scope = iota
	// Mounter checks need the mounter's view: the host's /dev, the
	// image's tools, the cgroup it runs in.
	Mounter
)

// Check is one feature: how it is probed, what its absence disables.
type Check struct {
	// Feature names it in logs and in mountplan_preflight_feature.
	Feature string
	// Need says what is needed for it (a kernel version, a module, a package).
	Need string
	// Disables says what does not work without it.
	Disables string
	// Fatal: nothing can work without it in a process that mounts.
	Fatal bool
	Scope Scope
	Probe func(System) bool
}

// Result is a Check and its answer.
type Result struct {
	Check
	Available bool
}

// Report is every check's result, in the order of the checks.
type Report []Result

// Options say which checks run and which may fail the start.
type Options struct {
	// Mounts: this process performs mounts (the mounter, or a plugin with
	// no mounter of its own): the Mounter-scoped checks run, and a missing
	// Fatal feature is an error. Otherwise only Kernel checks run and none
	// is fatal: the mounter beside says what it lacks.
	Mounts bool
	// Tools are further programs to look for (FUSE profiles' binaries),
	// each with what it disables.
	Tools []Tool
}

// Tool is a program the mounter runs and what needs it.
type Tool struct {
	Name, Package, Disables string
}

// Run runs the checks that apply and returns their results; the error
// (wrapping errdefs.ErrFailedPrecondition) names every missing fatal
// feature when the process mounts.
func Run(sys System, opts Options) (Report, error) {
	checks := Checks(opts.Tools)
	var rep Report
	var fatal []string
	for _, c := range checks {
		if c.Scope == Mounter && !opts.Mounts {
			continue
		}
		r := Result{Check: c, Available: c.Probe(sys)}
		rep = append(rep, r)
		if !r.Available && c.Fatal && opts.Mounts {
			fatal = append(fatal, r.Message())
		}
	}
	if len(fatal) > 0 {
		return rep, fmt.Errorf("preflight: %s: %w", strings.Join(fatal, "; "), errdefs.ErrFailedPrecondition)
	}
	return rep, nil
}

// Message says what is missing, what it disables and what is needed.
func (r Result) Message() string {
	return fmt.Sprintf("%s is missing (needs %s); it disables: %s", r.Feature, r.Need, r.Disables)
}

// Missing returns the results whose feature is missing.
func (rep Report) Missing() Report {
	var out Report
	for _, r := range rep {
		if !r.Available {
			out = append(out, r)
		}
	}
	return out
}

// Log logs each missing feature once, with what it disables, and one line
// naming those present.
func (rep Report) Log(logger klog.Logger, kernel string) {
	var ok []string
	for _, r := range rep {
		if r.Available {
			ok = append(ok, r.Feature)
			continue
		}
		logger.Info("Preflight: a feature is missing", "feature", r.Feature, "need", r.Need, "disables", r.Disables, "fatal", r.Fatal)
	}
	logger.Info("Preflight", "kernel", kernel, "available", ok, "missing", len(rep.Missing()))
}

// Available reports the features by name: true when present.
func (rep Report) Available() map[string]bool {
	m := make(map[string]bool, len(rep))
	for _, r := range rep {
		m[r.Feature] = r.Available
	}
	return m
}

// Checks returns every check, the tools after the kernel's features.
func Checks(extra []Tool) []Check {
	checks := []Check{
		{Feature: "fsopen", Need: "Linux 5.2", Fatal: true, Scope: Kernel,
			Disables: "every volume (the mounter builds each mount with fsopen/fsmount/move_mount)",
			Probe:    func(s System) bool { return s.HasSyscall(SyscallFsopen) }},
		{Feature: "mount_setattr", Need: "Linux 5.12", Fatal: true, Scope: Kernel,
			Disables: "every volume (mount flags and propagation are set with mount_setattr)",
			Probe:    func(s System) bool { return s.HasSyscall(SyscallMountSetattr) }},
		{Feature: "openat2", Need: "Linux 5.6", Fatal: true, Scope: Kernel,
			Disables: "every stage and publish (paths below kubelet's directory and the state dir are resolved with openat2, never following a symlink out)",
			Probe:    func(s System) bool { return s.HasSyscall(SyscallOpenat2) }},
		{Feature: "move_mount_beneath", Need: "Linux 6.5", Scope: Kernel,
			Disables: "replacing a FUSE volume's dead mount (heal) and an NRI guard without a moment where the mount point shows the directory under it",
			Probe:    func(s System) bool { return kernelAtLeast(s.Kernel(), 6, 5) }},
		{Feature: "open_tree_detached", Need: "Linux 6.15", Scope: Kernel,
			Disables: "subPath of volumes in NRI mode (open_tree of a detached mount)",
			Probe:    func(s System) bool { return kernelAtLeast(s.Kernel(), 6, 15) }},
		{Feature: "nbd", Need: "the kernel module nbd (modprobe nbd)", Scope: Kernel,
			Disables: "nbd volumes",
			Probe:    func(s System) bool { return s.NetlinkFamily("nbd") || s.Exists("/sys/module/nbd") }},
		{Feature: "nbd_backend", Need: "Linux 5.13", Scope: Kernel,
			Disables: "nbd volumes (each connection is named by a backend identifier, which the mounter finds its devices by)",
			Probe:    func(s System) bool { return kernelAtLeast(s.Kernel(), 5, 13) }},
		{Feature: "iscsi_tcp", Need: "the kernel module iscsi_tcp, or iscsiadm and iscsid on the host to load it", Scope: Kernel,
			Disables: "iscsi volumes",
			Probe:    func(s System) bool { return s.Exists("/sys/module/iscsi_tcp") || s.HasProgram("iscsiadm") }},
		{Feature: "loop", Need: "/dev/loop-control (the kernel module loop)", Scope: Mounter,
			Disables: "loop volumes (the default type) and overlay chains' scratch devices",
			Probe:    func(s System) bool { return s.Exists("/dev/loop-control") }},
		{Feature: "fuse", Need: "/dev/fuse (the kernel module fuse)", Scope: Mounter,
			Disables: "fuse volumes",
			Probe:    func(s System) bool { return s.Exists("/dev/fuse") }},
		{Feature: "cgroup2", Need: "cgroup v2 at /sys/fs/cgroup (a unified host)", Scope: Mounter,
			Disables: "FUSE profiles' resource limits without --host-cgroupfs (daemons then run in the mounter's cgroup, unlimited; with it they run in v1 cgroups of their own outside the mounter's, limited)",
			Probe:    func(s System) bool { return s.Cgroup2() }},
	}
	for _, t := range append(Tools(), extra...) {
		checks = append(checks, Check{Feature: "tool:" + t.Name, Need: "package " + t.Package, Scope: Mounter,
			Disables: t.Disables, Probe: func(s System) bool { return s.HasProgram(t.Name) }})
	}
	return checks
}

// Tools are the programs the mounter runs (internal/fsutil,
// internal/mounter's iSCSI), with what each one's absence disables.
func Tools() []Tool {
	return []Tool{
		{Name: "blkid", Package: "util-linux", Disables: "staging a filesystem volume (its filesystem is detected before the first format)"},
		{Name: "mkfs.ext4", Package: "e2fsprogs", Disables: "ext4 volumes (format)"},
		{Name: "e2fsck", Package: "e2fsprogs", Disables: "ext4 volumes (check before a resize)"},
		{Name: "resize2fs", Package: "e2fsprogs", Disables: "expanding ext4 volumes"},
		{Name: "mkfs.xfs", Package: "xfsprogs", Disables: "xfs volumes (format)"},
		{Name: "xfs_growfs", Package: "xfsprogs", Disables: "expanding xfs volumes"},
		{Name: "xfs_admin", Package: "xfsprogs", Disables: "restoring and cloning xfs volumes (a new UUID)"},
		{Name: "iscsiadm", Package: "open-iscsi", Disables: "iscsi volumes (login, node records)"},
	}
}

// kernelAtLeast reports whether release (uname -r: "6.5.0-1-amd64") is at
// least major.minor; a release it cannot read counts as older.
func kernelAtLeast(release string, major, minor int) bool {
	var ma, mi int
	if _, err := fmt.Sscanf(release, "%d.%d", &ma, &mi); err != nil {
		return false
	}
	return slices.Compare([]int{ma, mi}, []int{major, minor}) >= 0
}

// Start runs the checks on this node (Real), logs what is missing once,
// and returns the report; the error stops a process that mounts (see Run).
func Start(logger klog.Logger, opts Options) (Report, error) {
	sys := Real{}
	rep, err := Run(sys, opts)
	rep.Log(logger, sys.Kernel())
	return rep, err
}

// ProfileTools are the FUSE profiles' binaries as tools to look for: each
// disables its profile.
func ProfileTools(profiles []fuseprofile.Profile) []Tool {
	var out []Tool
	for _, p := range profiles {
		out = append(out, Tool{Name: p.Binary, Package: "the binary of fuse profile " + p.Name,
			Disables: fmt.Sprintf("fuse volumes of profile %q", p.Name)})
	}
	return out
}
