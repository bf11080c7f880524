package daemon

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// stage is where the shim builds the daemon's root before it pivots into
// it: /proc, which every process has and the daemon must not see (its own
// /proc replaces it), so that a tmpfs stacked on it hides nothing the
// root is built from and needs no directory made on the host.
const stage = "/proc"

// runSandbox is the shim: it builds the daemon's root, drops to its user
// and execs it; it returns only on failure. Everything happens on the
// main thread, locked, because the credentials that execve hands on are
// the calling thread's (prctl acts on one thread).
func runSandbox() error {
	runtime.LockOSThread()
	req, err := readSandboxRequest()
	if err != nil {
		return err
	}
	if err := buildRoot(req.Sandbox); err != nil {
		return err
	}
	if err := dropPrivileges(req.RunAs); err != nil {
		return err
	}
	if err := loadDaemonFilter(); err != nil {
		return err
	}
	// Nothing of the shim's reaches the daemon but fds 0-3.
	if err := unix.CloseRange(sandboxFd, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return os.NewSyscallError("close_range", err)
	}
	if err := syscall.Exec(req.Path, append([]string{req.Path}, req.Args...), req.Env); err != nil {
		return fmt.Errorf("exec %s: %w", req.Path, err)
	}
	return nil
}

// buildRoot makes the new mount namespace private (nothing mounted here
// reaches the node's, nor the node's later mounts this one), builds the
// root on a tmpfs at stage, pivots into it, detaches the old root with
// everything the namespace copied from the mounter's (the kubelet dir,
// the host's /dev and /proc, every other volume's mounts) and mounts a
// /proc of the daemon's own PID namespace.
func buildRoot(sb Sandbox) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making the mount namespace private: %w", err)
	}
	if err := unix.Mount("mountplan-daemon-root", stage, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m,nr_inodes=4096"); err != nil {
		return fmt.Errorf("the root's tmpfs: %w", err)
	}
	for _, p := range SystemPaths {
		if err := addSystemPath(p); err != nil {
			return err
		}
	}
	const ro = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV
	for _, p := range sb.ReadOnly {
		if err := bindInto(p, true, ro); err != nil {
			return err
		}
	}
	for _, p := range sb.Writable {
		if err := bindInto(p, true, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV); err != nil {
			return err
		}
	}
	if err := makeDev(); err != nil {
		return err
	}
	if err := os.Mkdir(stage+"/proc", 0o555); err != nil {
		return err
	}
	return pivot()
}

// addSystemPath binds p read-only into the root, or copies it as a
// symlink; a path the host lacks is left out.
func addSystemPath(p string) error {
	fi, err := os.Lstat(p)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case err != nil:
		return err
	case fi.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(p)
		if err != nil {
			return err
		}
		return os.Symlink(target, stage+p)
	}
	return bindInto(p, true, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
}

// makeDev makes the root's /dev: SandboxDevices bound from the host's
// (nosuid, noexec; a device node on a nodev mount would not open), and
// the usual symlinks into /proc/self/fd.
func makeDev() error {
	if err := os.Mkdir(stage+"/dev", 0o755); err != nil {
		return err
	}
	for _, d := range SandboxDevices {
		if err := bindInto("/dev/"+d, false, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NOEXEC); err != nil {
			return err
		}
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, stage+"/dev/"+name); err != nil {
			return err
		}
	}
	return nil
}

// bindInto binds the host path p (recursively: with what is mounted below
// it) at the same path in the root, with attr on every mount of the bind.
// The directories leading to it are made in the root's tmpfs; none of
// them may be a symlink there (one copied from SystemPaths), which would
// lead the bind out of the root.
func bindInto(p string, recursive bool, attr uint64) error {
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" {
		return fmt.Errorf("cannot bind %q into the root: not a clean absolute path", p)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	target := stage + p
	if err := mkdirsIn(filepath.Dir(p)); err != nil {
		return err
	}
	if fi.IsDir() {
		err = os.Mkdir(target, 0o755)
	} else {
		var f *os.File
		if f, err = os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644); err == nil {
			err = f.Close()
		}
	}
	// A path below another bind (a root under /usr) exists there.
	if err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	flags := uintptr(unix.MS_BIND)
	if recursive {
		flags |= unix.MS_REC
	}
	if err := unix.Mount(p, target, "", flags, ""); err != nil {
		return fmt.Errorf("binding %s into the root: %w", p, err)
	}
	setFlags := 0
	if recursive {
		setFlags = unix.AT_RECURSIVE
	}
	if err := unix.MountSetattr(unix.AT_FDCWD, target, uint(setFlags), &unix.MountAttr{Attr_set: attr}); err != nil {
		return fmt.Errorf("the flags of %s in the root: %w", p, err)
	}
	return nil
}

// mkdirsIn makes dir and its parents in the root, refusing a symlink.
func mkdirsIn(dir string) error {
	cur := stage
	for _, c := range strings.Split(strings.TrimPrefix(dir, "/"), "/") {
		if c == "" {
			continue
		}
		cur += "/" + c
		fi, err := os.Lstat(cur)
		switch {
		case errors.Is(err, os.ErrNotExist):
			if err := os.Mkdir(cur, 0o755); err != nil {
				return err
			}
		case err != nil:
			return err
		case !fi.IsDir():
			return fmt.Errorf("%s in the daemon's root is no directory (a symlink of the system's?)", strings.TrimPrefix(cur, stage))
		}
	}
	return nil
}

// pivot makes the tmpfs at stage the root (pivot_root(".", ".") stacks
// the old root on it, which the detach then takes away), mounts the
// daemon's /proc and turns the root's tmpfs read-only.
func pivot() error {
	if err := unix.Chdir(stage); err != nil {
		return err
	}
	err := unix.PivotRoot(".", ".")
	switch {
	case errors.Is(err, unix.EINVAL):
		// The root is the initramfs (rootfs), which cannot be pivoted
		// away from (a machine that runs from its initramfs, as the test
		// VM's guest does). As runc without pivot_root: the new root is
		// moved over "/" and chrooted into. The old root's mounts stay in
		// this namespace, hidden below it and out of reach of a daemon
		// without CAP_SYS_CHROOT and with no descriptor of theirs; its
		// log says so.
		if err := moveRoot(); err != nil {
			return err
		}
		fmt.Fprintln(os.Stderr, "mountplan: the daemon's sandbox: the root is an initramfs, which pivot_root cannot leave: its new root is moved over it instead (the mounter's mounts stay hidden below)")
	case err != nil:
		return fmt.Errorf("pivot_root: %w", err)
	default:
		if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
			return fmt.Errorf("detaching the old root: %w", err)
		}
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	// subset=pid: the daemon's /proc shows processes (its own PID
	// namespace's) and nothing of the kernel's (sys, kcore, sysrq-trigger).
	const procFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	err = unix.Mount("proc", "/proc", "proc", procFlags, "subset=pid")
	if errors.Is(err, unix.EINVAL) { // before Linux 5.8
		err = unix.Mount("proc", "/proc", "proc", procFlags, "")
	}
	if err != nil {
		return fmt.Errorf("the daemon's /proc: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("making the root read-only: %w", err)
	}
	return nil
}

// moveRoot makes the mount at the working directory the root without
// pivot_root: moved over "/", then chrooted into.
func moveRoot() error {
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("moving the new root over /: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot into the new root: %w", err)
	}
	return nil
}

// dropPrivileges turns the calling thread into u's, for good: no
// supplementary group, no capability in any set (the bounding set
// emptied and no_new_privs set while still root, by restrictThread),
// then checked.
func dropPrivileges(u User) error {
	if err := restrictThread(nil); err != nil {
		return err
	}
	// Go's Setgroups and Setres[ug]id act on every thread of the process.
	if err := syscall.Setgroups([]int{}); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(int(u.GID), int(u.GID), int(u.GID)); err != nil {
		return fmt.Errorf("setresgid(%d): %w", u.GID, err)
	}
	if err := syscall.Setresuid(int(u.UID), int(u.UID), int(u.UID)); err != nil {
		return fmt.Errorf("setresuid(%d): %w", u.UID, err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	if slices.ContainsFunc(data[:], func(d unix.CapUserData) bool { return d.Effective|d.Permitted|d.Inheritable != 0 }) {
		return errors.New("capabilities left after the change of user")
	}
	return nil
}
